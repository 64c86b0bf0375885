"""Request bodies of the OpenAI-compatible API, checked as bodies before anything reaches the
engine; what a request means for this model (token ids in its vocabulary, the context, the
cache) is the input processor's to decide (`engine/input_processor.py`), for serve, the
gateway and `LLM` alike.

Types are strict (no bool as an int, no string as a number, finite floats only); `check()`
adds what types cannot say: ranges of seeds and biases, no lone surrogates, chat-template
kwargs that may not override the template's own inputs. Fields kvpool does not know are
accepted and ignored (logged once per name per process, as vLLM does); fields it knows but
does not implement are refused unless neutral (`kvpool.serve.unsupported`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpool.engine.input_processor import check_token_ids
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams
from kvpool.serve.sampling_map import control_params
from kvpool.serve.unsupported import refuse_unsupported

logger = logging.getLogger(__name__)

SEED_LIMIT = 2**64  # seeds are torch generator seeds: 0 <= seed + sample index < 2**64
# what a chat template receives from kvpool itself; `chat_template_kwargs` may not replace it
TEMPLATE_INPUTS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents",
                             "continue_final_message", "chat_template", "tokenize", "conversation"})
_MAX_LOGGED_NAMES = 256  # a client inventing field names cannot grow the set (or the log) without bound
_logged_names: set[str] = set()


def note_ignored(names: list[str]) -> None:
    """One log line per ignored field name per process."""
    for name in names:
        if name in _logged_names or len(_logged_names) >= _MAX_LOGGED_NAMES:
            continue
        _logged_names.add(name)
        logger.info("ignoring request field %s (kvpool does not act on it)", ascii(name[:64]))


def check_text(value: Any, param: str) -> None:
    """Every string in a JSON value must be valid Unicode (a lone surrogate cannot be tokenized)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(f"{param} contains a lone surrogate (an invalid \\u escape)",
                                     param=param) from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(x for x in v if not isinstance(x, int))


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def check_strings(self) -> None:
        for name, value in self.model_dump().items():  # extras included
            check_text(value, name)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat; `sampling_params` turns them into SamplingParams."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = None
    # kvpool: "shared" opts into the prefix cache shared by every tenant (see docs/serving.md)
    cache_scope: Literal["tenant", "shared"] = "tenant"
    stream: bool = False
    stream_options: StreamOptions | None = None
    # sampling controls and output constraints (`kvpool.serve.sampling_map`); null means off
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def check(self) -> None:
        """Everything types cannot express; raises InvalidRequest naming the param. Also logs
        the ignored fields and refuses the unsupported ones."""
        extra = dict(self.model_extra or {})
        refuse_unsupported(extra)
        note_ignored(sorted(extra))
        self.check_strings()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequest("stream_options.continuous_usage_stats is not implemented (usage comes in the "
                                 "last chunk with include_usage)", param="stream_options.continuous_usage_stats")
        if self.seed is not None and not (self.seed >= 0 and self.seed + max(1, self.n) - 1 < SEED_LIMIT):
            raise InvalidRequest(f"seed must be in 0..2**64-n ({SEED_LIMIT - max(1, self.n)} for n={self.n}), "
                                 f"got {self.seed}", param="seed")
        control_params(self)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.use_beam_search and self.stream:
            raise InvalidRequest("beam search cannot stream", param="stream")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams.from_dict({
            "n": self.n, "max_tokens": max_tokens, "min_tokens": self.min_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": self.seed, "stop": stop, "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos, "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty, "prompt_logprobs": prompt_logprobs,
            **control_params(self),
        })

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: top-N logprobs of every prompt token
    # keep prompt prefixes cached: an object or a list of them (serve/retention_fields.py)
    kvpool_retention: dict[str, Any] | list[dict[str, Any]] | None = None

    def check(self) -> None:
        super().check()
        prompts = self.prompt_list()
        if not prompts or any(not p for p in prompts):
            raise InvalidRequest("prompt is empty", param="prompt")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top-N of the prompt tokens' logprobs to compute: vLLM's prompt_logprobs and, with echo,
        `logprobs` (echo with max_tokens 0 scores the prompt alone, so it needs them too)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if self.echo and self.max_tokens == 0 and not wanted:
            wanted = [0]
        return max(wanted, default=None)

    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Body):
    type: str  # only "function" exists; checked by name in `ChatCompletionRequest.check`
    function: FunctionDef


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: str
    function: ToolChoiceFunction


class CalledFunction(_Body):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; templates get it parsed


class AssistantToolCall(_Body):
    id: str | None = None
    type: str = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest("only text content parts are supported", param="messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        out = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.tool_calls is not None:
            out["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def template_tool_call(call: AssistantToolCall) -> dict[str, Any]:
    """A past tool call as HF chat templates read it: arguments as a mapping when they parse."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": args}}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        check_template_kwargs(self.chat_template_kwargs)
        check_tools(self.tools, self.tool_choice)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_tools(tools: list[ToolDef] | None, choice: str | NamedToolChoice | None) -> None:
    """Function tools with distinct names; a tool_choice other than "none" needs tools, and a
    named one must name one of them."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise InvalidRequest(f"tools[{i}].type must be \"function\", got {tool.type!r}", param="tools")
        if tool.function.name in names:
            raise InvalidRequest(f"tools: function {tool.function.name!r} is defined twice", param="tools")
        names.add(tool.function.name)
    if choice is None or choice == "none":
        return
    if not names:
        raise InvalidRequest(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'!r} "
                             "needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise InvalidRequest(f"tool_choice.type must be \"function\", got {choice.type!r}", param="tool_choice")
        if choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                                 param="tool_choice")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    clash = sorted(set(kwargs or {}) & TEMPLATE_INPUTS)
    if clash:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(clash)} (kvpool passes them itself)",
                             param="chat_template_kwargs")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None  # rendered into the template as chat does

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        note_ignored(sorted(self.model_extra or {}))
        self.check_strings()
        check_template_kwargs(self.chat_template_kwargs)
        check_tools(self.tools, None)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

    def check(self, vocab_size: int | None) -> None:
        """Tokens of this vocabulary: /detokenize never reaches the engine, so the input
        processor's check runs here."""
        note_ignored(sorted(self.model_extra or {}))
        self.check_strings()
        check_token_ids(self.tokens, vocab_size, "tokens")
