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
from kvpool.serve.front import chat_choice, chat_delta, response_head, role_delta
from kvpool.serve.http_metrics import received_s
from kvpool.serve.protocol import ChatCompletionRequest, ChatMessage
from kvpool.serve.responses import (
    Cursor,
    StreamUsage,
    chat_logprobs,
    collect,
    sse_stream,
    system_fingerprint,
    unless_disconnected,
    usage,
)
from kvpool.serve.retention_fields import chat_marks, chat_retention
from kvpool.serve.sampling_map import compact_json
from kvpool.serve.state import ServerState
from kvpool.serve.tools import CallStream, ToolPlan


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
    req.check()
    marks = chat_marks(req.messages)
    lora = state.check_model(req.model)
    plan = ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_call_parser)
    ids = await state.off_loop(render_request, state.tokenizer, req, plan)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = state.default_max_tokens(len(ids), req.n)
    params = plan.constrain(req.sampling_params(max_tokens, req.num_logprobs), compact_json(req))
    params.lora = lora
    if marks:
        kwargs = {**(req.chat_template_kwargs or {}), **({"tools": plan.template_tools} if plan.template_tools else {})}
        params.retention = await state.off_loop(chat_retention, state.tokenizer, req.messages, marks, kwargs,
                                                req.add_generation_prompt, req.add_special_tokens)
    rid = state.engine.new_request_id(prefix)
    salt = request_salt(raw, req.cache_salt, req.cache_scope)
    stream = await state.engine.submit(rid, [ids], params, arrival, salt, received_s(raw))
    return ChatRun(rid, plan, params, stream)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    run = await submit_chat(state, req, raw)
    plan, stream = run.plan, run.stream
    head = response_head(run.rid, int(time.time()), state.reported_model(req.model), system_fingerprint(state))
    if req.stream:
        chunks = _chunks(state, req, plan, head, stream)
        return StreamingResponse(sse_stream(chunks), media_type="text/event-stream")
    out = (await unless_disconnected(raw, collect(stream)))[0]
    choices = [_choice(state, plan, c) for c in out.outputs]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage({0: out})})


def _choice(state: ServerState, plan: ToolPlan, c: CompletionOutput) -> dict[str, Any]:
    return whole_choice(plan, c.index, c.text, chat_logprobs(state.tokenizer, c, 0), c.finish_reason, c.stop_reason)


def whole_choice(plan: ToolPlan, index: int, text: str, logprobs: dict[str, Any] | None,
                 finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
    """A whole chat choice: the text as the assistant's message, its tool calls parsed out."""
    calls = plan.stream()
    content, found = calls.message(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if found:
        message["tool_calls"] = [call.as_message_part() for call in found]
    return chat_choice(index, message, logprobs, plan.finish_reason(finish_reason, calls.called), stop_reason)


def delta_choices(plan: ToolPlan, calls: CallStream, index: int, text: str, done: bool,
                  logprobs: dict[str, Any] | None, new_tokens: bool, finish_reason: str | None,
                  stop_reason: int | str | None) -> list[dict[str, Any]]:
    """One sample's new text as chat chunk choices: one per piece (a tool call's header, then its
    arguments), logprobs on the first, the finish reason on the last; none while there is nothing
    to say (e.g. a forced call's JSON before its name is known)."""
    pieces = calls.feed(text) + (calls.finish() if done else [])
    if not pieces and not done and (not new_tokens or logprobs is None):
        return []
    pieces = pieces or [{}]
    last = len(pieces) - 1
    return [chat_delta(index, delta, logprobs if k == 0 else None,
                       plan.finish_reason(finish_reason, calls.called) if k == last and done else None,
                       stop_reason if k == last and done else None) for k, delta in enumerate(pieces)]


async def _chunks(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan, head: dict[str, Any],
    stream: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[dict[str, Any]]:
    head = {**head, "object": "chat.completion.chunk"}
    for i in range(req.n):  # the role comes first, as OpenAI sends it
        yield {**head, "choices": [role_delta(i)]}
    cursors = [Cursor() for _ in range(req.n)]
    calls = [plan.stream() for _ in range(req.n)]
    tally = StreamUsage()
    async for _, out in stream:  # the engine's deltas
        tally.add(0, out)
        for c in out.outputs:
            cur = cursors[c.index]
            if cur.done:
                continue
            cur.advance(c)
            for choice in delta_choices(plan, calls[c.index], c.index, c.text, cur.done,
                                        chat_logprobs(state.tokenizer, c, 0), bool(c.token_ids),
                                        c.finish_reason, c.stop_reason):
                yield {**head, "choices": [choice]}
    if req.include_usage and tally.last:
        yield {**head, "choices": [], "usage": tally.usage()}
