"""Streaming the calls of `tool_choice: "required"` while they are generated.

The grammar makes the output a JSON array of `{"name": NAME, "arguments": VALUE}` objects, keys
in that order, with any whitespace between tokens. `CallArrayScanner` reads it incrementally: a
call's name is reported as soon as its string closes, then the arguments' text as it arrives
(the raw JSON the model writes, as vLLM streams it), so a UI can show a call while it is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_SPACE = " \t\n\r"


@dataclass(slots=True)
class CallEvent:
    """A call's name (`name` set, it begins) or a piece of its arguments' text."""

    index: int
    name: str | None = None
    arguments: str = ""


class CallArrayScanner:
    """Feed text deltas; get the calls' names and argument fragments as soon as they are known."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "between"  # between -> name -> key -> value -> tail -> between ... -> end
        self._calls = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scalar = False  # a value that is not an object, array or string (number, true, ...)

    @property
    def started(self) -> bool:
        """Has any call begun (its name has been reported)?"""
        return self._calls > 0

    def feed(self, text: str) -> list[CallEvent]:
        self._buf += text
        out: list[CallEvent] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[CallEvent]) -> bool:
        """Consume what the current state can; False when more text is needed."""
        buf = self._buf
        if self._state == "between":
            rest = buf.lstrip(_SPACE + "[,")
            if rest.startswith("]"):
                self._state, self._buf = "end", ""
                return False
            self._buf = rest
            if not rest:
                return False
            self._state = "name"
            return True
        if self._state == "name":
            m = _NAME.match(buf)
            if m is None:
                return False
            out.append(CallEvent(self._calls, name=json.loads(m.group(1))))
            self._calls += 1
            self._state, self._buf = "key", buf[m.end():]
            return True
        if self._state == "key":
            m = _ARGUMENTS_KEY.match(buf)
            if m is None:
                return False
            self._state, self._buf = "value", buf[m.end():]
            self._depth, self._in_string, self._escaped, self._scalar = 0, False, False, False
            return True
        if self._state == "value":
            if not (self._depth or self._in_string or self._scalar):
                buf = self._buf = buf.lstrip(_SPACE)  # nothing of the value yet: no leading space
                if not buf:
                    return False
            end = self._value_end(buf)
            piece = buf if end is None else buf[:end]
            if piece:
                out.append(CallEvent(self._calls - 1, arguments=piece))
            self._buf = "" if end is None else buf[end:]
            if end is None:
                return False
            self._state = "tail"
            return True
        if self._state == "tail":
            rest = buf.lstrip(_SPACE)
            if not rest.startswith("}"):
                self._buf = rest
                return False
            self._state, self._buf = "between", rest[1:]
            return True
        return False  # end: nothing after the array matters

    def _value_end(self, buf: str) -> int | None:
        """Where the arguments' JSON value ends in `buf` (None: it goes on), tracking nesting
        and strings across calls."""
        for i, ch in enumerate(buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1
                continue
            if self._scalar:
                if ch in _SPACE + ",}]":
                    return i
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            elif self._depth == 0 and ch not in _SPACE:
                self._scalar = True
        return None
