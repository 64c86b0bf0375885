"""POST /v1/chat/completions: messages rendered by the model's chat template, then generated."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvpool.engine.outputs import CompletionOutput, RequestOutput
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams
from kvpool.serve.auth import request_salt
from kvpool.serve.protocol import ChatCompletionRequest, ChatMessage
from kvpool.serve.responses import (
    Cursor,
    chat_logprobs,
    collect,
    holdback_for,
    sse_stream,
    system_fingerprint,
    unless_disconnected,
    usage,
)
from kvpool.serve.sampling_map import compact_json
from kvpool.serve.state import ServerState
from kvpool.serve.tools import ToolPlan


def render(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
           template_kwargs: dict[str, Any] | None, add_special_tokens: bool,
           tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the messages through the model's chat template (blocking: run it off the loop)."""
    inputs = [m.as_template_input() for m in messages]
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(inputs, add_generation_prompt=add_generation_prompt, **extra)
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - the template runs on client data: its failure is a bad request
        raise InvalidRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                             param="messages") from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_request(tokenizer: Any, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    return render(tokenizer, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                  req.add_special_tokens, plan.template_tools)


@dataclass(slots=True)
class ChatRun:
    """A chat request submitted to the engine: its tool plan, parameters and output stream."""

    rid: str
    plan: ToolPlan
    params: SamplingParams
    stream: AsyncIterator[tuple[int, RequestOutput]]


async def submit_chat(state: ServerState, req: ChatCompletionRequest, raw: Request, prefix: str = "chatcmpl",
                      arrival: float | None = None) -> ChatRun:
    """Validate, render and submit (shared by /v1/chat/completions and /v1/responses)."""
    arrival = time.monotonic() if arrival is None else arrival
    req.check(state.vocab_size)
    state.check_model(req.model)
    plan = ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_call_parser)
    ids = await state.off_loop(render_request, state.tokenizer, req, plan)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = state.default_max_tokens(len(ids), req.n)
    params = plan.constrain(req.sampling_params(max_tokens, req.num_logprobs), compact_json(req))
    rid = state.engine.new_request_id(prefix)
    salt = request_salt(raw, req.cache_salt, req.cache_scope)
    stream = await state.engine.submit(rid, [ids], params, arrival, salt)
    return ChatRun(rid, plan, params, stream)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    run = await submit_chat(state, req, raw)
    plan, params, stream = run.plan, run.params, run.stream
    head = {"id": run.rid, "created": int(time.time()), "model": state.model_name,
            "system_fingerprint": system_fingerprint(state)}
    if req.stream:
        chunks = _chunks(state, req, plan, head, stream, holdback_for(params.stop))
        return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")
    out = (await unless_disconnected(raw, collect(stream)))[0]
    choices = [_choice(state, plan, c) for c in out.outputs]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage({0: out})})


def _choice(state: ServerState, plan: ToolPlan, c: CompletionOutput) -> dict[str, Any]:
    calls = plan.stream()
    content, found = calls.message(c.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if found:
        message["tool_calls"] = [call.as_message_part() for call in found]
    return {"index": c.index, "message": message, "logprobs": chat_logprobs(state.tokenizer, c, 0),
            "finish_reason": plan.finish_reason(c.finish_reason, calls.called), "stop_reason": c.stop_reason}


async def _chunks(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, head: dict[str, Any],
    stream: AsyncIterator[tuple[int, RequestOutput]], holdback: int,
) -> AsyncIterator[dict[str, Any]]:
    head = {**head, "object": "chat.completion.chunk"}
    for i in range(req.n):  # the role comes first, as OpenAI sends it
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    cursors = [Cursor() for _ in range(req.n)]
    calls = [plan.stream() for _ in range(req.n)]
    last: RequestOutput | None = None
    async for _, out in stream:
        last = out
        for c in out.outputs:
            cur = cursors[c.index]
            if cur.done:
                continue
            text, first = cur.advance(c, holdback)
            pieces = calls[c.index].feed(text) + (calls[c.index].finish() if cur.done else [])
            if not pieces and not cur.done and (first == cur.tokens_sent or c.logprobs is None):
                continue  # nothing to say yet (e.g. a forced call's JSON before its name is known)
            # one chunk per piece (a tool call's header, then its arguments); logprobs ride on
            # the first, the finish reason on the last
            pieces = pieces or [{}]
            for k, delta in enumerate(pieces):
                final = k == len(pieces) - 1 and cur.done
                yield {**head, "choices": [{
                    "index": c.index, "delta": delta,
                    "logprobs": chat_logprobs(state.tokenizer, c, first) if k == 0 else None,
                    "finish_reason": plan.finish_reason(c.finish_reason, calls[c.index].called) if final else None,
                    "stop_reason": c.stop_reason if final else None,
                }]}
    if req.include_usage and last is not None:
        yield {**head, "choices": [], "usage": usage({0: last})}
