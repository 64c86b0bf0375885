"""POST /v1/completions: prompts (text or token ids) in, choices out, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.serve.auth import request_salt
from kvpool.serve.protocol import CompletionRequest
from kvpool.serve.responses import (
    Cursor,
    collect,
    completion_logprobs,
    echo_logprobs,
    holdback_for,
    prompt_complete,
    sse_stream,
    system_fingerprint,
    unless_disconnected,
    usage,
    vllm_prompt_logprobs,
)
from kvpool.serve.state import ServerState


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    arrival = time.monotonic()
    req.check(state.vocab_size)
    state.check_model(req.model)
    tok = state.tokenizer
    prompts = req.prompt_list()
    ids, texts = await state.off_loop(_encode, tok, prompts, req.echo, req.add_special_tokens)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = state.default_max_tokens(max(len(p) for p in ids), req.n)
    params = req.sampling_params(max_tokens, req.logprobs, req.num_prompt_logprobs)
    rid = state.engine.new_request_id("cmpl")
    salt = request_salt(raw, req.cache_salt, req.cache_scope)
    stream = await state.engine.submit(rid, ids, params, arrival, salt)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name,
            "system_fingerprint": system_fingerprint(state)}
    if req.stream:
        chunks = _chunks(state, req, head, stream, texts, holdback_for(params.stop))
        return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")
    outputs = await unless_disconnected(raw, collect(stream))
    choices = []
    for p_index, out in sorted(outputs.items()):
        for c in out.outputs:
            echo = texts[p_index] if req.echo else ""
            choices.append({
                "index": p_index * req.n + c.index, "text": echo + c.text,
                "logprobs": _logprobs(tok, req, out, c, 0, len(echo), first_chunk=True),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **_prompt_field(tok, req, out),
            })
    choices.sort(key=lambda ch: ch["index"])
    return JSONResponse({**head, "object": "text_completion", "choices": choices, "usage": usage(outputs)})


def _logprobs(tok, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, start: int, offset: int,
              first_chunk: bool) -> dict[str, Any] | None:
    """Logprobs of generated tokens `start:`; with echo, the first chunk begins with the prompt's."""
    generated = completion_logprobs(tok, c, start, offset)
    if first_chunk and req.echo and req.logprobs is not None:
        return echo_logprobs(tok, out, req.logprobs, generated)
    return generated


def _prompt_field(tok, req: CompletionRequest, out: RequestOutput) -> dict[str, Any]:
    if req.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(tok, out, req.prompt_logprobs)}


def _encode(tok, prompts: list[str | list[int]], echo: bool, add_special_tokens: bool,
            ) -> tuple[list[list[int]], list[str]]:
    """Token ids of every prompt, and the text `echo` shows (blocking: run it off the loop)."""
    ids = [tok.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p for p in prompts]
    texts = [p if isinstance(p, str) else (tok.decode(p) if echo else "") for p in prompts]
    return ids, texts


async def _chunks(
    state: ServerState, req: CompletionRequest, head: dict[str, Any],
    stream: AsyncIterator[tuple[int, RequestOutput]], texts: list[str], holdback: int,
) -> AsyncIterator[dict[str, Any]]:
    cursors: dict[int, Cursor] = {}
    last: dict[int, RequestOutput] = {}
    head = {**head, "object": "text_completion"}
    wait_prompt = req.num_prompt_logprobs is not None
    async for p_index, out in stream:
        last[p_index] = out
        for c in out.outputs:
            index = p_index * req.n + c.index
            cur = cursors.get(index)
            echo = texts[p_index] if req.echo else ""
            prefix, first_chunk = "", cur is None
            if cur is None:
                if wait_prompt and not prompt_complete(out) and c.finish_reason is None:
                    continue  # the first chunk carries the prompt's logprobs: all of them
                cur = cursors[index] = Cursor()
                prefix = echo
            if cur.done:
                continue
            delta, first = cur.advance(c, holdback)
            if not delta and first == cur.tokens_sent and not cur.done and not (first_chunk and prefix):
                continue
            yield {**head, "choices": [{
                "index": index, "text": prefix + delta,
                "logprobs": _logprobs(state.tokenizer, req, out, c, first, len(echo) + cur.text_sent - len(delta),
                                      first_chunk),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **(_prompt_field(state.tokenizer, req, out) if first_chunk else {}),
            }]}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage(last)}
