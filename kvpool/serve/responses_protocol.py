"""The body of POST /v1/responses (OpenAI's Responses API) and its translation into the chat
request kvpool already validates and serves: `input` items become messages, `instructions` the
system message, flat function tools chat tools, `text.format` the response_format.

Fields that would change what is generated and are not implemented are refused by name
(`previous_response_id`: kvpool keeps no responses; tools other than functions; `truncation:
"auto"`; `background`); `store`, `metadata`, `user` and `reasoning` change nothing here and are
accepted (a stored response could never be retrieved, so every response reports `store: false`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

from kvpool.errors import InvalidRequest
from kvpool.serve.protocol import ChatCompletionRequest, _Body

# chat's field -> the Responses API's, for errors
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# the Responses API's own fields; everything else a client sends is passed on as chat's extras
_OWN = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "store",
                  "metadata", "user", "reasoning", "previous_response_id", "truncation", "background",
                  "include", "top_logprobs", "stream", "parallel_tool_calls", "service_tier", "prompt_cache_key"})


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None

    def refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequest("previous_response_id is not supported: kvpool keeps no responses; send the "
                                 "conversation in input", param="previous_response_id")
        if self.truncation == "auto":
            raise InvalidRequest("truncation \"auto\" is not supported (an input that does not fit is a 400)",
                                 param="truncation")
        if self.background:
            raise InvalidRequest("background responses are not supported", param="background")
        if self.include:
            raise InvalidRequest(f"include {self.include[:4]} is not supported", param="include")
        if self.top_logprobs:
            raise InvalidRequest("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                                 param="top_logprobs")

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat request (validated as chat's are when it is served)."""
        self.refuse_unsupported()
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k not in _OWN}
        body.update(model=self.model, messages=self.messages(), temperature=self.temperature, top_p=self.top_p,
                    parallel_tool_calls=self.parallel_tool_calls, stream=self.stream)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            loc = [str(p) for p in err.get("loc", ())]
            param = _PARAMS.get(loc[0], loc[0]) if loc else None
            raise InvalidRequest(f"{param}: {err.get('msg', 'invalid')} (at {'.'.join(loc[1:]) or param})",
                                 param=param) from None

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            _add_item(out, item, i)
        if not out:
            raise InvalidRequest("input is empty", param="input")
        return out


def _add_item(out: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequest(f"input[{i}].role must be user, assistant, system or developer", param="input")
        out.append({"role": role, "content": _text(item.get("content"), i)})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None and not last["content"]:
            last["tool_calls"].append(call)  # parallel calls are one assistant turn
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = _text(output, i)
        out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    else:
        raise InvalidRequest(f"input[{i}].type {str(kind)[:32]!r} is not supported (message, function_call, "
                             "function_call_output)", param="input")


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{i}].content must be text or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"input[{i}]: content part {str(kind)[:32]!r} is not supported (only text)",
                                 param="input")
        parts.append(part["text"])
    return "\n".join(parts)


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest(f"tools[{i}].type {str(tool.get('type'))[:32]!r} is not supported (function only)",
                             param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequest("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                             param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidRequest(f"text.format.type {str(kind)[:32]!r} is not supported (text, json_object, json_schema)",
                         param="text")
