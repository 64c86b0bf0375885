"""Tool calling for /v1/chat/completions: what the template sees, how a call is forced, and how
the model's text becomes `tool_calls`.

- `none` (or no tools): the text is the answer; the template still receives the tools.
- named: the output is constrained (xgrammar, through `structured_outputs`) to the function's
  arguments schema; the whole text is that call's `arguments`.
- `required`: the output is constrained to a JSON array of `{"name": ..., "arguments": ...}`,
  one object per call (`maxItems` 1 when `parallel_tool_calls` is false); `call_array` streams
  each call's name, then its arguments, while they are generated.
- `auto`: the model writes freely and the server's `--tool-call-parser` finds its calls.

Every mode runs through one `CallStream` per choice, fed the text deltas as they are decoded;
the non-streaming response feeds the whole text at once, so both paths give the same calls
and the same content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams, StructuredOutputs
from kvpool.serve.call_array import CallArrayScanner, CallEvent

TOOL_CALL_PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_NO_ARGUMENTS = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)

    def as_message_part(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """One request's tool mode, built once its fields are valid (`protocol.check_tools`)."""

    mode: str  # "none" | "auto" | "required" | "named"
    functions: dict[str, dict[str, Any]]  # name -> arguments schema
    template_tools: list[dict[str, Any]] | None  # what the chat template receives as `tools`
    name: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Any] | None, choice: Any, parallel: bool, parser: str | None) -> ToolPlan:
        """The request's plan; `auto` needs the server's `--tool-call-parser` (a 400 otherwise,
        so calls never come back unparsed as if they were the answer)."""
        functions = {t.function.name: t.function.parameters or _NO_ARGUMENTS for t in tools or []}
        rendered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        if choice is None:
            choice = "auto" if functions else "none"
        if not functions or choice == "none":
            return cls("none", functions, rendered)
        if choice == "auto" and parser is None:
            raise InvalidRequest("tool_choice \"auto\" needs the server started with --tool-call-parser "
                                 "(e.g. hermes); \"required\", a named function and \"none\" work without it",
                                 param="tool_choice")
        if isinstance(choice, str):
            return cls(choice, functions, rendered, parallel=parallel)
        return cls("named", functions, rendered, name=choice.function.name, parallel=parallel)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced call's output must match (None: free text)."""
        if self.mode == "named":
            return self.functions[self.name]
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.functions.items()]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def constrain(self, params: SamplingParams, compact: bool = False) -> SamplingParams:
        """Force the call's JSON; `compact` is vLLM's disable_any_whitespace."""
        schema = self.schema()
        if schema is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequest("a forced tool_choice cannot be combined with another output constraint "
                                 "(response_format or guided_*)", param="tool_choice")
        return replace(params, structured_outputs=StructuredOutputs(json=schema, disable_any_whitespace=compact))

    def stream(self) -> CallStream:
        return CallStream(self)

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """"tool_calls" when the model stopped after calling (a named call keeps "stop", as OpenAI)."""
        if engine_reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


class CallStream:
    """Turns one choice's text deltas into pieces of an OpenAI delta: `{"content": ...}` or
    `{"tool_calls": [one item]}` (a call's id and name first, then its arguments)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[Call] = []
        self._named_started = False
        self._named_args: list[str] = []
        self._text = ""  # required: everything so far (content if no call ever starts)
        self._array = CallArrayScanner() if plan.mode == "required" else None
        self._hermes = HermesParser(set(plan.functions)) if plan.mode == "auto" else None

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        match self.plan.mode:
            case "named":
                return self._named(text)
            case "required":
                self._text += text
                return self._array_calls(self._array.feed(text))
            case "auto":
                return self._events(self._hermes.feed(text))
            case _:
                return [{"content": text}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        """What is left once the choice has finished."""
        if self.plan.mode == "auto":
            return self._events(self._hermes.finish())
        if self.plan.mode == "required" and not self.calls and self._text:
            return [{"content": self._text}]  # cut short (length) before one call began
        if self.plan.mode == "named" and not self._named_started:
            return self._named("")
        return []

    def message(self, text: str) -> tuple[str | None, list[Call]]:
        """Content and calls of a whole (non-streamed) text."""
        pieces = self.feed(text) + self.finish()
        content = "".join(p.get("content", "") for p in pieces)
        return (content or None) if self.calls else content, self.calls

    # -- modes -----------------------------------------------------------------------------
    def _named(self, text: str) -> list[dict[str, Any]]:
        out = []
        if not self._named_started:
            self._named_started = True
            self.calls.append(Call(self.plan.name, ""))
            out.append(_header(0, self.calls[0]))
        if text:
            self._named_args.append(text)
            self.calls[0] = replace(self.calls[0], arguments="".join(self._named_args))
            out.append(_arguments(0, text))
        return out

    def _array_calls(self, events: list[CallEvent]) -> list[dict[str, Any]]:
        """A call's header as soon as its name is known, then its arguments as they arrive."""
        out: list[dict[str, Any]] = []
        for e in events:
            if e.name is not None:
                self.calls.append(Call(e.name, ""))
                out.append(_header(e.index, self.calls[e.index]))
            else:
                call = self.calls[e.index]
                self.calls[e.index] = replace(call, arguments=call.arguments + e.arguments)
                out.append(_arguments(e.index, e.arguments))
        return out

    def _events(self, events: list[str | Call]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            out += [{"content": e}] if isinstance(e, str) else self._emit(e)
        return out

    def _emit(self, call: Call) -> list[dict[str, Any]]:
        index = len(self.calls)
        self.calls.append(call)
        return [_header(index, call), _arguments(index, call.arguments)]


def _header(index: int, call: Call) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}]}


def _arguments(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


class HermesParser:
    """Hermes-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    Text outside blocks is content; whitespace next to a block is dropped (it only separates
    blocks). A block that is not a JSON call of a known function stays in the content verbatim,
    so nothing the model wrote is lost. Text that could be the start of `<tool_call>` is held
    back until the next delta tells; a block is held until it closes (or the output ends).
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._buf = ""
        self._inside = False
        self._space = ""  # trailing whitespace held until we know whether a block follows
        self._after_call = False  # drop the whitespace that follows a call
        self._called = False

    def feed(self, text: str) -> list[str | Call]:
        self._buf += text
        out: list[str | Call] = []
        while True:
            if self._inside:
                end = self._buf.find(_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(_CLOSE):]
                self._inside = False
                out += self._block(body, closed=True)
                continue
            start = self._buf.find(_OPEN)
            if start >= 0:
                out += self._text(self._buf[:start])
                self._buf, self._inside = self._buf[start + len(_OPEN):], True
                continue
            keep = _partial_suffix(self._buf, _OPEN)
            out += self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[str | Call]:
        """Flush: an unclosed block still counts if its JSON is a complete call."""
        out = self._block(self._buf, closed=False) if self._inside else self._text(self._buf)
        self._buf, self._inside = "", False
        if self._space and not self._called:
            out.append(self._space)  # text without calls comes back exactly as generated
        self._space = ""
        return out

    def _text(self, text: str) -> list[str | Call]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out, self._space = self._space + body, text[len(body):]
        return [out]

    def _block(self, body: str, closed: bool) -> list[str | Call]:
        call = self._call(body)
        if call is None:  # not a call: the block is text, with the whitespace it had
            raw = _OPEN + body + (_CLOSE if closed else "")
            held, self._space, self._after_call = self._space, "", False
            return [held + raw]
        self._space, self._after_call, self._called = "", True, True
        return [call]

    def _call(self, body: str) -> Call | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
