"""Offline prompts in every form `LLM.generate` accepts, vLLM's included.

A prompt is text, a list of token ids, or a dict: `{"prompt": text}` or
`{"prompt_token_ids": [...]}` (vLLM's TextPrompt / TokensPrompt), optionally with a
`cache_salt`. A dict key kvpool does not act on (multi-modal data, ...) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import InvalidRequest

_DICT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass(frozen=True, slots=True)
class Prompt:
    prompt: str | list[int]
    cache_salt: str | None = None


def _one(p: Any) -> Prompt:
    if isinstance(p, str):
        return Prompt(p)
    if isinstance(p, Mapping):
        unknown = sorted(set(p) - _DICT_KEYS)
        if unknown:
            raise InvalidRequest(f"prompt field(s) not supported: {', '.join(unknown)}", param=unknown[0])
        if ("prompt" in p) == ("prompt_token_ids" in p):
            raise InvalidRequest("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'", param="prompt")
        salt = p.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest("cache_salt must be a string", param="cache_salt")
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise InvalidRequest("'prompt' must be a string (token ids go in 'prompt_token_ids')", param="prompt")
            return Prompt(p["prompt"], salt)
        return Prompt(_token_ids(p["prompt_token_ids"]), salt)
    return Prompt(_token_ids(p))


def _token_ids(ids: Any) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise InvalidRequest("token-id prompts must be lists of integers", param="prompt_token_ids")
    return list(ids)


def normalize_prompts(prompts: Any) -> list[Prompt]:
    """One prompt (text, token ids or dict) or a list of them -> a list of Prompt."""
    if isinstance(prompts, str | Mapping):
        return [_one(prompts)]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [_one(prompts)]
    if not isinstance(prompts, Sequence):
        raise InvalidRequest(f"prompts must be text, token ids, a prompt dict or a list of them, got {type(prompts).__name__}",
                             param="prompt")
    return [_one(p) for p in prompts]
