"""POST /v1/completions: prompts (text or token ids) in, choices out, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.serve.auth import request_salt
from kvpool.serve.front import completion_choice, response_head
from kvpool.serve.http_metrics import received_s
from kvpool.serve.protocol import CompletionRequest
from kvpool.serve.responses import (
    Cursor,
    StreamUsage,
    collect,
    completion_logprobs,
    echo_logprobs,
    sse_stream,
    system_fingerprint,
    unless_disconnected,
    usage,
    vllm_prompt_logprobs,
)
from kvpool.serve.retention_fields import completion_retention
from kvpool.serve.state import ServerState


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    arrival = time.monotonic()
    req.check()
    lora = state.check_model(req.model)
    tok = state.tokenizer
    prompts = req.prompt_list()
    if req.echo or any(isinstance(p, str) for p in prompts):
        ids, texts = await state.off_loop(_encode, tok, prompts, req.echo, req.add_special_tokens)
    else:  # token ids and no echo: nothing to tokenize, so no hop to the tokenizer threads and back
        ids, texts = _encode(tok, prompts, False, req.add_special_tokens)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = state.default_max_tokens(max(len(p) for p in ids), req.n)
    params = req.sampling_params(max_tokens, req.logprobs, req.num_prompt_logprobs)
    params.lora = lora
    params.retention = completion_retention(req.kvpool_retention, prompts, tok, req.add_special_tokens)
    rid = state.engine.new_request_id("cmpl")
    salt = request_salt(raw, req.cache_salt, req.cache_scope)
    stream = await state.engine.submit(rid, ids, params, arrival, salt, received_s(raw))
    head = response_head(rid, int(time.time()), state.reported_model(req.model), system_fingerprint(state))
    if req.stream:
        chunks = _chunks(state, req, head, stream, texts)
        return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")
    outputs = await unless_disconnected(raw, collect(stream))
    choices = []
    for p_index, out in sorted(outputs.items()):
        for c in out.outputs:
            echo = texts[p_index] if req.echo else ""
            choices.append({
                **completion_choice(p_index * req.n + c.index, echo + c.text,
                                    _logprobs(tok, req, out, c, 0, len(echo), first_chunk=True),
                                    c.finish_reason, c.stop_reason),
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
    texts = [p if isinstance(p, str) else (_echo_text(tok, p) if echo else "") for p in prompts]
    return ids, texts


def _echo_text(tok, ids: list[int]) -> str:
    """A token prompt's text for echo. Ids the tokenizer cannot hold (negative, past 2**32)
    have none: the input processor refuses them by name when the request is submitted."""
    try:
        return tok.decode(ids)
    except OverflowError:
        return ""


async def _chunks(
    state: ServerState, req: CompletionRequest, head: dict[str, Any],
    stream: AsyncIterator[tuple[int, RequestOutput]], texts: list[str],
) -> AsyncIterator[dict[str, Any]]:
    """A chunk per choice per engine delta with something to say; a choice's first chunk
    carries its echo and the prompt's logprobs (the request's first record holds them)."""
    cursors: dict[int, Cursor] = {}
    tally = StreamUsage()
    firsts: dict[int, RequestOutput] = {}  # each prompt's first record: its prompt logprobs
    head = {**head, "object": "text_completion"}
    async for p_index, out in stream:
        tally.add(p_index, out)
        first_out = firsts.setdefault(p_index, out)
        for c in out.outputs:
            index = p_index * req.n + c.index
            cur = cursors.get(index)
            echo = texts[p_index] if req.echo else ""
            prefix, first_chunk = "", cur is None
            if cur is None:
                cur = cursors[index] = Cursor()
                prefix = echo
            if cur.done:
                continue
            offset = len(echo) + cur.text_sent
            cur.advance(c)
            if not c.text and not c.token_ids and not cur.done and not (first_chunk and prefix):
                continue
            yield {**head, "choices": [{
                **completion_choice(index, prefix + c.text,
                                    _logprobs(state.tokenizer, req, first_out, c, 0, offset, first_chunk),
                                    c.finish_reason, c.stop_reason),
                **(_prompt_field(state.tokenizer, req, first_out) if first_chunk else {}),
            }]}
    if req.include_usage:
        yield {**head, "choices": [], "usage": tally.usage()}
