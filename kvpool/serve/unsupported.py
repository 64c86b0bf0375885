"""Request fields that would change the output and that kvpool does not implement (yet).

Unknown fields are ignored (as vLLM does), but a field in this table changes what the client
gets back, so ignoring it would be silently wrong: it is refused with a 400 naming it unless it
has its neutral value. To support a field, implement it, declare it in `protocol.py` (a
declared field never reaches this table) and delete its row here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.errors import InvalidRequest


def _absent(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _flag(neutral: bool) -> Callable[[Any], bool]:
    return lambda v: v is None or v is neutral


def _one_of(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in neutral)


# field -> "is this value neutral?" (the predicate sees any JSON value, so it never raises)
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "allowed_token_ids": _absent,
    "logits_processors": _absent,
    "prompt_logprobs": _absent,  # chat only: completions declares it
    "tools": _absent,
    "tool_choice": _one_of("none"),
    "functions": _absent,
    "function_call": _one_of("none"),
    "suffix": _absent,
    "echo": _flag(False),  # chat only: completions declares echo
    "continue_final_message": _flag(False),
    "chat_template": _absent,
    "documents": _absent,
    "return_tokens_as_token_ids": _flag(False),
    "spaces_between_special_tokens": _flag(True),
    "truncate_prompt_tokens": _absent,
    "early_stopping": _flag(False),
    "modalities": lambda v: _absent(v) or v == ["text"],
    "audio": _absent,
    "prediction": _absent,
}


def refuse_unsupported(extra: dict[str, Any]) -> None:
    """Raise InvalidRequest for the first undeclared field that is in the table and not neutral."""
    for name, value in extra.items():
        neutral = NEUTRAL.get(name)
        if neutral is not None and not neutral(value):
            raise InvalidRequest(f"{name} is not supported by kvpool (only its neutral value is accepted)",
                                 param=name)
