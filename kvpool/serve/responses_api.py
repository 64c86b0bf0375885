"""POST /v1/responses: OpenAI's Responses API over the chat path (`kvpool.serve.chat`).

The request becomes a chat request (`responses_protocol`); the generated text runs through the
same `CallStream` as chat, so tools and structured output behave alike. The output is a list of
items (a `message` with one `output_text` part, `function_call`s); streaming sends the API's
typed events (`response.created` ... `response.completed`), each with its `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvpool.engine.outputs import OutputAccumulator, RequestOutput
from kvpool.serve.chat import ChatRun, submit_chat
from kvpool.serve.errors import classify
from kvpool.serve.responses import Cursor, collect, unless_disconnected
from kvpool.serve.responses_protocol import ResponsesRequest
from kvpool.serve.state import ServerState


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The response's output items, built from chat delta pieces; each change is also an event."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its item

    def apply(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one piece: `{"content": ...}` or `{"tool_calls": [one item]}`."""
        if "content" in piece:
            return self._text(piece["content"]) if piece["content"] else []
        call = piece["tool_calls"][0]
        out = self._close_message()
        fn = call["function"]
        if "id" in call:  # a call begins
            item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn["name"],
                    "arguments": "", "status": "in_progress"}
            self._calls[call["index"]] = item
            self.items.append(item)
            return out + [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": dict(item)}]
        item = self._calls[call["index"]]
        item["arguments"] += fn["arguments"]
        return out + [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                       "output_index": self.items.index(item), "delta": fn["arguments"]}]

    def finish(self) -> list[dict[str, Any]]:
        out = self._close_message()
        for item in self._calls.values():
            if item["status"] == "in_progress":
                item["status"] = "completed"
                index = self.items.index(item)
                out += [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                         "name": item["name"], "arguments": item["arguments"]},
                        {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        msg = self._message
        if msg is None:
            msg = self._message = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                                   "content": []}
            self.items.append(msg)
            index = len(self.items) - 1
            out += [{"type": "response.output_item.added", "output_index": index, "item": {**msg, "content": []}},
                    {"type": "response.content_part.added", "item_id": msg["id"], "output_index": index,
                     "content_index": 0, "part": _part("")}]
            msg["content"].append(_part(""))
        msg["content"][0]["text"] += text
        return out + [{"type": "response.output_text.delta", "item_id": msg["id"], "output_index": self.items.index(msg),
                       "content_index": 0, "delta": text, "logprobs": []}]

    def _close_message(self) -> list[dict[str, Any]]:
        msg, self._message = self._message, None
        if msg is None:
            return []
        msg["status"] = "completed"
        index, part = self.items.index(msg), msg["content"][0]
        return [{"type": "response.output_text.done", "item_id": msg["id"], "output_index": index, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": msg["id"], "output_index": index,
                 "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index,
                 "item": {**msg, "content": [dict(part)]}}]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _response(state: ServerState, req: ResponsesRequest, rid: str, created: int, status: str,
              items: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
    reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
    if status == "completed" and reason == "length":
        status = "incomplete"
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": state.reported_model(req.model),
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "output": items, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
        "reasoning": None, "store": False, "temperature": req.temperature, "top_p": req.top_p,
        "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "truncation": req.truncation or "disabled", "user": req.user,
        "usage": _usage(out) if out is not None else None,
    }


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request):
    arrival = time.monotonic()
    run = await submit_chat(state, req.chat_request(), raw, prefix="resp", arrival=arrival)
    rid, created = _id("resp"), int(time.time())
    if req.stream:
        return StreamingResponse(_events(state, req, run, rid, created), media_type="text/event-stream")
    out = (await unless_disconnected(raw, collect(run.stream)))[0]
    items = OutputItems()
    calls = run.plan.stream()
    for piece in calls.feed(out.outputs[0].text) + calls.finish():
        items.apply(piece)
    items.finish()
    return JSONResponse(_response(state, req, rid, created, "completed", items.items, out))


async def _events(state: ServerState, req: ResponsesRequest, run: ChatRun, rid: str,
                  created: int) -> AsyncIterator[str]:
    """The API's server-sent events: `event: TYPE` and its JSON, numbered in order."""
    seq = 0

    def event(payload: dict[str, Any]) -> str:
        nonlocal seq
        payload = {**payload, "sequence_number": seq}
        seq += 1
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    items, calls, cursor = OutputItems(), run.plan.stream(), Cursor()
    yield event({"type": "response.created", "response": _response(state, req, rid, created, "in_progress", [], None)})
    yield event({"type": "response.in_progress",
                 "response": _response(state, req, rid, created, "in_progress", [], None)})
    folded, last = OutputAccumulator(), None
    try:
        async for _, out in run.stream:  # the engine's deltas, folded for the usage at the end
            folded.add(out)
            last = out
            if not out.outputs:
                continue
            cursor.advance(out.outputs[0])
            for piece in calls.feed(out.outputs[0].text) + (calls.finish() if cursor.done else []):
                for e in items.apply(piece):
                    yield event(e)
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        body = classify(e)[1]["error"]
        yield event({"type": "response.failed", "response": {
            **_response(state, req, rid, created, "failed", items.items, last and folded.result()), "error": body}})
        return
    for e in items.finish():
        yield event(e)
    final = _response(state, req, rid, created, "completed", items.items, last and folded.result())
    yield event({"type": f"response.{final['status']}", "response": final})
