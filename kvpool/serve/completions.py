"""POST /v1/completions: prompts (text or token ids) in, choices out, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvpool.engine.outputs import RequestOutput
from kvpool.serve.auth import request_salt
from kvpool.serve.protocol import CompletionRequest
from kvpool.serve.responses import (
    Cursor,
    collect,
    completion_logprobs,
    holdback_for,
    sse_stream,
    unless_disconnected,
    usage,
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
    params = req.sampling_params(max_tokens, req.logprobs)
    rid = state.engine.new_request_id("cmpl")
    salt = request_salt(raw, req.cache_salt, req.cache_scope)
    stream = await state.engine.submit(rid, ids, params, arrival, salt)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
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
                "logprobs": completion_logprobs(tok, c, 0, len(echo)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            })
    choices.sort(key=lambda ch: ch["index"])
    return JSONResponse({**head, "object": "text_completion", "choices": choices, "usage": usage(outputs)})


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
    async for p_index, out in stream:
        last[p_index] = out
        for c in out.outputs:
            index = p_index * req.n + c.index
            cur = cursors.get(index)
            prefix = ""
            if cur is None:
                cur = cursors[index] = Cursor()
                prefix = texts[p_index] if req.echo else ""
            if cur.done:
                continue
            delta, first = cur.advance(c, holdback)
            if not delta and first == cur.tokens_sent and not cur.done:
                continue
            yield {**head, "choices": [{
                "index": index, "text": prefix + delta,
                "logprobs": completion_logprobs(state.tokenizer, c, first, cur.text_sent - len(delta)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            }]}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage(last)}
