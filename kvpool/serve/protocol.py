"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Unknown fields are refused (extra="forbid") so a misspelt sampling parameter is a 400 rather
than silently ignored. OpenAI fields kvpool does not implement are accepted only at their
neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields without a kvpool implementation: accepted only when they change nothing
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension; `vllm bench serve` always sends 1.0
    logit_bias: dict[str, float] | None = None

    def check(self) -> None:
        """Semantic checks that pydantic's types cannot express; raise InvalidRequest with the param."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0.0:
                raise InvalidRequest(f"{name} is not supported (must be 0)", param=name)
        if self.repetition_penalty != 1.0:
            raise InvalidRequest("repetition_penalty is not supported (must be 1)", param="repetition_penalty")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            "length_penalty": self.length_penalty,
        })

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, self.n):
            raise InvalidRequest("best_of is not supported (use n or use_beam_search)", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs needs prompt logprobs, which kvpool does not compute",
                                 param="echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequest("prompt is empty", param="prompt")

    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest("only text content parts are supported", param="messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
