"""The OpenAI front's shared pieces: `kvpool serve` and the conductor's gateway check a request's
model, fill its defaults and shape their responses with these, so the same request gets the
same answer (and the same error) from either; the gateway only adds routing."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from kvpool.serve.errors import ModelNotFound


def check_model(model: str | None, name: str, aliases: Collection[str] = ()) -> None:
    """No model, the served name or an alias; else 404 model_not_found."""
    if model and model != name and model not in aliases:
        raise ModelNotFound(f"model {model!r} does not exist; this server serves {name!r}", param="model")


def model_card(model_id: str, root: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvpool", "root": root,
            "max_model_len": max_model_len}


def model_list(names: Sequence[str], root: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """GET /v1/models: a card per served name, the first being the id responses report."""
    return {"object": "list", "data": [model_card(n, root, created, max_model_len) for n in names]}


def default_max_tokens(prompt_len: int, n: int, max_model_len: int, kv_capacity_tokens: int | None) -> int:
    """A request without max_tokens gets the rest of the context: what fits in the model's window
    and (when known) in the KV pool for its n samples; at least 1."""
    room = max_model_len if kv_capacity_tokens is None else min(max_model_len, kv_capacity_tokens // max(1, n))
    return max(1, room - prompt_len)


def usage_counts(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_head(rid: str, created: int, model: str, fingerprint: str | None) -> dict[str, Any]:
    """What every response and chunk of one request starts with."""
    head = {"id": rid, "created": created, "model": model}
    if fingerprint is not None:
        head["system_fingerprint"] = fingerprint
    return head


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None,
                      stop_reason: int | str | None) -> dict[str, Any]:
    """One choice of a text completion, whole or one chunk's."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, message: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None,
                stop_reason: int | str | None) -> dict[str, Any]:
    """One choice of a whole chat completion."""
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
    """One choice of a chat chunk."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def role_delta(index: int) -> dict[str, Any]:
    """A chat stream's first chunk for each choice: the role, as OpenAI sends it."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
