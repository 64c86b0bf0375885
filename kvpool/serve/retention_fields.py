"""Retention asked for in a request body (issue 32 item 1; the core is core/retention.py).

Chat: Anthropic's `cache_control` on a text content part or on a message,
`{"type": "ephemeral", "ttl": "5m" | "1h"}` (ttl optional, 5m by default): the prompt up to
and including that part (message) is kept cached for the TTL from the request's arrival; each
marked point is its own retention (up to MAX_BREAKPOINTS). Completions: kvpool's
`kvpool_retention: {"prefix_tokens": N | "prefix_chars": N, "ttl": "1h", "priority": P}`
(no prefix: the whole prompt; `prefix_chars` needs one text prompt). A TTL is `<int>s|m|h`,
at most 1h on a request (Anthropic's longest; a longer hold is an operator's pin, up to the
core's bound); a priority an integer in the core's range. Anything else is a 400
naming the field. The retention covers the full blocks of the prefix, under the request's
tenant salt (the hashes carry it), so one tenant's retention never holds another's blocks.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvpool.core.retention import MAX_PRIORITY, MIN_PRIORITY, RetentionRequest
from kvpool.errors import InvalidRequest

MAX_BREAKPOINTS = 4  # as Anthropic
DEFAULT_TTL = "5m"
MAX_REQUEST_TTL_S = 3600.0  # what one request may hold the cache for (pins: MAX_TTL_S)
_TTL = re.compile(r"([1-9][0-9]{0,6})([smh])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_COMPLETION_KEYS = {"prefix_tokens", "prefix_chars", "ttl", "priority"}


def parse_ttl(value: Any, param: str, limit_s: float = MAX_REQUEST_TTL_S) -> float:
    """'30s', '5m', '1h' -> seconds; 400 naming `param` for anything else or past `limit_s`."""
    m = _TTL.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise InvalidRequest(f"{param} must be a duration such as \"5m\" or \"1h\" (<int>s|m|h), got {value!r}",
                             param=param)
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds > limit_s:
        raise InvalidRequest(f"{param} must be at most {limit_s:g}s, got {value!r}", param=param)
    return float(seconds)


def parse_priority(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidRequest(f"{param} must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, got {value!r}",
                             param=param)
    return value


def _count(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{param} must be an integer >= 1, got {value!r}", param=param)
    return value


def completion_retention(spec: Any, prompts: list[str | list[int]], tokenizer: Any,
                         add_special_tokens: bool) -> tuple[RetentionRequest, ...]:
    """The `kvpool_retention` field of a completions request (an object, or a list of up to
    MAX_BREAKPOINTS: the form a relay sends a chat's breakpoints in) as the engine's retention."""
    if spec is None:
        return ()
    if isinstance(spec, list):
        if not 1 <= len(spec) <= MAX_BREAKPOINTS:
            raise InvalidRequest(f"kvpool_retention takes 1..{MAX_BREAKPOINTS} objects, got {len(spec)}",
                                 param="kvpool_retention")
        return tuple(_one_retention(s, f"kvpool_retention[{i}]", prompts, tokenizer, add_special_tokens)
                     for i, s in enumerate(spec))
    return (_one_retention(spec, "kvpool_retention", prompts, tokenizer, add_special_tokens),)


def _one_retention(spec: Any, name: str, prompts: list[str | list[int]], tokenizer: Any,
                   add_special_tokens: bool) -> RetentionRequest:
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{name} must be an object", param=name)
    for key in spec:
        if key not in _COMPLETION_KEYS:
            raise InvalidRequest(f"{name}.{key} is not a retention field (use {sorted(_COMPLETION_KEYS)})",
                                 param=f"{name}.{key}")
    if "prefix_tokens" in spec and "prefix_chars" in spec:
        raise InvalidRequest(f"{name}: give prefix_tokens or prefix_chars, not both", param=f"{name}.prefix_chars")
    ttl = parse_ttl(spec.get("ttl", DEFAULT_TTL), f"{name}.ttl")
    priority = parse_priority(spec.get("priority", 0), f"{name}.priority")
    prefix = None
    if "prefix_tokens" in spec:
        prefix = _count(spec["prefix_tokens"], f"{name}.prefix_tokens")
    elif "prefix_chars" in spec:
        chars = _count(spec["prefix_chars"], f"{name}.prefix_chars")
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise InvalidRequest(f"{name}.prefix_chars needs one text prompt (use prefix_tokens)",
                                 param=f"{name}.prefix_chars")
        prefix = len(tokenizer.encode(prompts[0][:chars], add_special_tokens=add_special_tokens))
    return RetentionRequest(prefix, ttl, priority)


def relayed(retention: tuple[RetentionRequest, ...]) -> list[dict[str, Any]]:
    """A request's retention as `kvpool_retention` for an instance (the gateway's relay)."""
    out = []
    for r in retention:
        item: dict[str, Any] = {"ttl": f"{int(r.ttl_s)}s", "priority": r.priority}
        if r.prefix_tokens is not None:
            item["prefix_tokens"] = r.prefix_tokens
        out.append(item)
    return out


def _cache_control(value: Any, param: str) -> float:
    """One `cache_control` object -> its TTL in seconds."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    for key in value:
        if key not in ("type", "ttl"):
            raise InvalidRequest(f"{param}.{key} is not supported (type, ttl)", param=f"{param}.{key}")
    if value.get("type") != "ephemeral":
        raise InvalidRequest(f"{param}.type must be \"ephemeral\", got {value.get('type')!r}", param=f"{param}.type")
    return parse_ttl(value.get("ttl", DEFAULT_TTL), f"{param}.ttl")


def chat_marks(messages: list[Any]) -> list[tuple[int, int | None, float]]:
    """The `cache_control` breakpoints of chat messages (pydantic ChatMessage): (message index,
    content part index or None for the whole message, ttl seconds), validated."""
    marks = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if isinstance(part, dict) and "cache_control" in part:
                    marks.append((i, j, _cache_control(part["cache_control"],
                                                       f"messages[{i}].content[{j}].cache_control")))
        extra = m.model_extra or {}
        if "cache_control" in extra:
            marks.append((i, None, _cache_control(extra["cache_control"], f"messages[{i}].cache_control")))
    if len(marks) > MAX_BREAKPOINTS:
        raise InvalidRequest(f"at most {MAX_BREAKPOINTS} cache_control breakpoints, got {len(marks)}",
                             param="messages")
    return marks


def template_inputs(messages: list[Any]) -> list[dict[str, Any]]:
    """What the chat template gets: the messages without their cache_control (a hint to kvpool)."""
    out = []
    for m in messages:
        d = m.as_template_input()
        d.pop("cache_control", None)
        out.append(d)
    return out


def chat_retention(tokenizer: Any, messages: list[Any], marks: list[tuple[int, int | None, float]],
                   template_kwargs: dict[str, Any], add_generation_prompt: bool,
                   add_special_tokens: bool) -> tuple[RetentionRequest, ...]:
    """Each breakpoint's prefix in tokens: the rendered conversation cut after the marked part
    (message), as far as it agrees with the whole rendering (blocking: run it off the loop)."""
    if not marks:
        return ()
    inputs = template_inputs(messages)
    full = tokenizer.apply_chat_template(inputs, add_generation_prompt=add_generation_prompt, **template_kwargs)
    out = []
    for i, j, ttl in marks:
        cut = [dict(d) for d in inputs[: i + 1]]
        if j is not None:
            cut[i]["content"] = "\n".join(p["text"] for p in messages[i].content[: j + 1])
        partial = tokenizer.apply_chat_template(cut, add_generation_prompt=False, **template_kwargs)
        chars = len(os.path.commonprefix([full, partial]))
        tokens = len(tokenizer.encode(full[:chars], add_special_tokens=add_special_tokens))
        out.append(RetentionRequest(tokens, ttl, 0))
    return tuple(out)
