"""POST /v1/chat/completions: messages rendered by the model's chat template, then generated."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvpool.engine.outputs import RequestOutput
from kvpool.errors import InvalidRequest
from kvpool.serve.auth import request_salt
from kvpool.serve.protocol import ChatCompletionRequest, ChatMessage
from kvpool.serve.responses import (
    Cursor,
    chat_logprobs,
    collect,
    holdback_for,
    sse_stream,
    unless_disconnected,
    usage,
)
from kvpool.serve.state import ServerState


def render(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
           template_kwargs: dict[str, Any] | None, add_special_tokens: bool) -> list[int]:
    """Token ids of the messages through the model's chat template (blocking: run it off the loop)."""
    inputs = [m.as_template_input() for m in messages]
    try:
        text = tokenizer.apply_chat_template(inputs, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - the template runs on client data: its failure is a bad request
        raise InvalidRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                             param="messages") from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_request(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    return render(tokenizer, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                  req.add_special_tokens)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    arrival = time.monotonic()
    req.check(state.vocab_size)
    state.check_model(req.model)
    ids = await state.off_loop(render_request, state.tokenizer, req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = state.default_max_tokens(len(ids), req.n)
    params = req.sampling_params(max_tokens, req.num_logprobs)
    rid = state.engine.new_request_id("chatcmpl")
    salt = request_salt(raw, req.cache_salt, req.cache_scope)
    stream = await state.engine.submit(rid, [ids], params, arrival, salt)
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    if req.stream:
        chunks = _chunks(state, req, head, stream, holdback_for(params.stop))
        return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")
    out = (await unless_disconnected(raw, collect(stream)))[0]
    choices = [{
        "index": c.index, "message": {"role": "assistant", "content": c.text},
        "logprobs": chat_logprobs(state.tokenizer, c, 0),
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
    } for c in out.outputs]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage({0: out})})


async def _chunks(
    state: ServerState, req: ChatCompletionRequest, head: dict[str, Any],
    stream: AsyncIterator[tuple[int, RequestOutput]], holdback: int,
) -> AsyncIterator[dict[str, Any]]:
    head = {**head, "object": "chat.completion.chunk"}
    for i in range(req.n):  # the role comes first, as OpenAI sends it
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    cursors = [Cursor() for _ in range(req.n)]
    last: RequestOutput | None = None
    async for _, out in stream:
        last = out
        for c in out.outputs:
            cur = cursors[c.index]
            if cur.done:
                continue
            delta, first = cur.advance(c, holdback)
            if not delta and first == cur.tokens_sent and not cur.done:
                continue
            yield {**head, "choices": [{
                "index": c.index, "delta": {"content": delta} if delta else {},
                "logprobs": chat_logprobs(state.tokenizer, c, first),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            }]}
    if req.include_usage and last is not None:
        yield {**head, "choices": [], "usage": usage({0: last})}
