"""Pieces shared by the completions and chat routes: usage, logprobs, stream cursors, SSE."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from kvpool.core.miss_reasons import DIFFERENT_SALT, FIRST_SEEN
from kvpool.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from kvpool.serve.errors import classify
from kvpool.serve.front import usage_counts


def system_fingerprint(state: Any) -> str:
    """OpenAI's `system_fingerprint`: names what produced the tokens (model identity, weight
    dtype, KV dtype), so a client sees when a change of configuration may change outputs."""
    engine = state.engine.engine
    ident = f"{engine.loaded.name}|{engine.dtype}|{engine.kv_dtype}|{engine.config.quantization}"
    return "fp_" + hashlib.sha256(ident.encode()).hexdigest()[:12]


def kv_breakdown(outputs: list[RequestOutput]) -> dict[str, dict[str, int]]:
    """kvpool's extension of `prompt_tokens_details`: prompt tokens by where their KV came from
    (`kvpool_sources`: device, a store tier) and, for the computed ones, why
    (`kvpool_miss_reasons`, kvpool/core/miss_reasons.py); together they sum to prompt_tokens.
    `different_salt` reads `first_seen` here: that the same tokens are cached under another salt
    is another tenant's secret (/metrics, the operator's view, keeps the reason)."""
    sources: dict[str, int] = {}
    misses: dict[str, int] = {}
    for o in outputs:
        split = o.metrics.prompt_sources
        if split is None:
            return {}
        for k, n in split.sources.items():
            sources[k] = sources.get(k, 0) + n
        for k, n in split.misses.items():
            k = FIRST_SEEN if k == DIFFERENT_SALT else k
            misses[k] = misses.get(k, 0) + n
    return {"kvpool_sources": sources, "kvpool_miss_reasons": misses}


def usage(outputs: dict[int, RequestOutput], completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage, with kvpool's breakdown of the prompt tokens (`kv_breakdown`) in its details
    (`completion_tokens`: counted by the caller from a stream's deltas, else those of `outputs`)."""
    out = openai_usage(outputs, completion_tokens)
    out["prompt_tokens_details"].update(kv_breakdown(list(outputs.values())))
    return out


def openai_usage(outputs: dict[int, RequestOutput], completion_tokens: int | None = None) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = completion_tokens if completion_tokens is not None else sum(
        len(c.token_ids) for o in outputs.values() for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs.values())
    return usage_counts(prompt, completion, cached)


def completion_logprobs(tokenizer, out: CompletionOutput, start: int, offset: int) -> dict[str, Any] | None:
    """OpenAI completions logprobs for generated tokens `start:`; text offsets begin at `offset`."""
    if out.logprobs is None:
        return None
    tokens = [tokenizer.token_text(t) for t in out.token_ids[start:]]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = out.top_logprobs or []
    return {
        "tokens": tokens,
        "token_logprobs": list(out.logprobs[start:]),
        "top_logprobs": [
            {tokenizer.token_text(tid): lp, **{tokenizer.token_text(i): v for i, v in top}}  # sampled + top-N (vLLM)
            for tid, lp, top in zip(out.token_ids[start:], out.logprobs[start:], tops[start:], strict=False)
        ],
        "text_offset": offsets,
    }


def echo_logprobs(tokenizer, out: RequestOutput, num_top: int,
                  generated: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI completions logprobs of an echoed prompt followed by the generated tokens'. The
    first prompt token has no logprob (nothing precedes it): null, as OpenAI and vLLM send."""
    ids = out.prompt_token_ids
    lps = list(out.prompt_logprobs or [])
    tops = out.prompt_top_logprobs or []
    tokens = [tokenizer.token_text(t) for t in ids]
    offsets, offset = [], 0
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top_logprobs = [
        None if lp is None else {tokens[i]: lp, **{tokenizer.token_text(t): v for t, v in tops[i][:num_top]}}
        for i, lp in enumerate(lps)
    ]
    merged = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_logprobs, "text_offset": offsets}
    for key in merged if generated else ():
        merged[key] = merged[key] + generated[key]
    return merged


def vllm_prompt_logprobs(tokenizer, out: RequestOutput, num_top: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for the
    token and its top-N; rank is null for a prompt token outside the top-N (kvpool keeps no rank)."""
    result: list[dict[str, Any] | None] = []
    tops = out.prompt_top_logprobs or []
    for i, lp in enumerate(out.prompt_logprobs or []):
        if lp is None:
            result.append(None)
            continue
        top = tops[i][:num_top]
        tid = out.prompt_token_ids[i]
        rank = next((r for r, (t, _) in enumerate(top, 1) if t == tid), None)
        entry = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.token_text(tid)}}
        for r, (t, v) in enumerate(top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": tokenizer.token_text(t)})
        result.append(entry)
    return result


def _token_entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tokenizer, out: CompletionOutput, start: int) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    tops = out.top_logprobs or []
    content = []
    for k, (tid, lp) in enumerate(zip(out.token_ids[start:], out.logprobs[start:], strict=False)):
        entry = _token_entry(tokenizer, tid, lp)
        top = tops[start + k] if start + k < len(tops) else []
        entry["top_logprobs"] = [_token_entry(tokenizer, i, v) for i, v in top]
        content.append(entry)
    return {"content": content}


@dataclass(slots=True)
class Cursor:
    """What one choice has streamed: its text length (logprob text offsets) and its end. The
    engine's deltas hold back text that may become a stop string already."""

    text_sent: int = 0
    tokens_sent: int = 0
    done: bool = False

    def advance(self, delta: CompletionOutput) -> None:
        self.text_sent += len(delta.text)
        self.tokens_sent += len(delta.token_ids)
        self.done = delta.finish_reason is not None


class StreamUsage:
    """A streamed request's usage from its deltas: each prompt's latest record and the tokens."""

    def __init__(self) -> None:
        self.last: dict[int, RequestOutput] = {}
        self.completion_tokens = 0

    def add(self, index: int, out: RequestOutput) -> None:
        self.last[index] = out
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> dict[str, Any]:
        return usage(self.last, self.completion_tokens)


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Frame chunks as server-sent events; an error after the headers went out becomes an event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        yield sse(classify(e)[1])
    yield sse("[DONE]")


async def unless_disconnected(request: Request, work: Awaitable[Any], poll_s: float = 0.5) -> Any:
    """Await `work`, cancelling it (and so aborting its requests) if the client hangs up."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def collect(stream: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    """The whole output of every prompt of a request (its deltas folded)."""
    acc: dict[int, OutputAccumulator] = {}
    async for index, out in stream:
        if index not in acc:
            acc[index] = OutputAccumulator()
        acc[index].add(out)
    return {index: a.result() for index, a in acc.items()}
