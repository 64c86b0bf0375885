"""Routes a cluster member offers its conductor (`kvpool serve --role ...`).

`GET /internal/state?since=N` returns the instance's load and the KV events (block hashes
registered / evicted in its device cache) after cursor N, as JSON with hex hashes; a cursor
the log no longer covers (a new conductor, or one that fell behind) gets a snapshot of every
block held instead. `retention` maps the hex hash of a held block stored with a retention or
re-retained after the cursor (every retained block, in a snapshot) to `{"ttl_s", "priority"}`
(ttl_s null: pinned until unpinned) or null (released or run out): a TTL left, not a deadline,
because the conductor's clock is not this process's. `POST /internal/generate` runs one
token-id prompt and streams NDJSON lines with the new token ids and text (and their logprobs
and top-N, the prompt's logprobs on the first line, when asked), which is what a prefill/decode
split needs.

Both need the cluster key (`--cluster-key`, which the conductor sends); without one they need an
API key like every other route. The conductor has already scoped `cache_salt` to the tenant, so
/internal/generate uses it as given.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kvpool.core.retention import Retention
from kvpool.errors import InvalidRequest, Overloaded
from kvpool.serve.errors import classify
from kvpool.serve.protocol import CompletionRequest
from kvpool.serve.responses import Cursor, kv_breakdown, system_fingerprint
from kvpool.serve.retention_fields import completion_retention
from kvpool.serve.state import ServerState

ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class KVEventLog:
    """Events numbered from 1, the last `capacity` kept, plus the set of blocks held now and
    their retentions (so a poller whose cursor fell out of the log can resynchronise from a
    snapshot)."""

    capacity: int = 100_000
    cursor: int = 0
    held: set[bytes] = field(default_factory=set)
    retained: dict[bytes, Retention] = field(default_factory=dict)  # of held blocks, engine clock
    _log: deque[tuple[int, str, bytes]] = field(default_factory=deque)

    def add(self, stored: list[bytes], evicted: list[bytes],
            retention: Mapping[bytes, Retention | None] | None = None) -> None:
        """Log a drain's net events (`Engine.drain_kv_events`): stored, evicted, retention."""
        for kind, hashes in (("stored", stored), ("evicted", evicted), ("retention", list(retention or ()))):
            for h in hashes:
                self.cursor += 1
                self._log.append((self.cursor, kind, h))
                if kind == "stored":
                    self.held.add(h)
                elif kind == "evicted":
                    self.held.discard(h)
                    self.retained.pop(h, None)
        for h, r in (retention or {}).items():
            if r is not None and h in self.held:
                self.retained[h] = r
            else:
                self.retained.pop(h, None)
        while len(self._log) > self.capacity:
            self._log.popleft()

    def since(self, cursor: int, now: float) -> dict[str, Any]:
        """Events after `cursor`, or a snapshot when the log does not reach back that far;
        retention TTLs as left at `now` (the engine's clock). A block is listed once, as its
        last event after `cursor` left it: the two lists carry no order, and a poller that is
        several drains behind (a lost answer, another poller) must read a block evicted and then
        stored again as held."""
        oldest = self._log[0][0] if self._log else self.cursor + 1
        if cursor <= 0 or cursor > self.cursor or cursor + 1 < oldest:
            return {"snapshot": True, "stored": [h.hex() for h in self.held], "evicted": [],
                    "retention": {h.hex(): _wire(r, now) for h, r in self.retained.items()}}
        last: dict[bytes, str] = {}  # each block's last stored or evicted event
        retention: list[bytes] = []
        for n, kind, h in self._log:
            if n > cursor:
                if kind == "retention":
                    retention.append(h)
                else:
                    last[h] = kind
        stored = [h for h, kind in last.items() if kind == "stored"]
        retained = self.retained
        wire = {h.hex(): _wire(retained[h], now) for h in stored if h in retained}
        wire.update((h.hex(), _wire(retained.get(h), now)) for h in retention if h in self.held)
        return {"snapshot": False, "stored": [h.hex() for h in stored],
                "evicted": [h.hex() for h, kind in last.items() if kind == "evicted"], "retention": wire}


def _wire(r: Retention | None, now: float) -> dict[str, Any] | None:
    """A retention as the conductor reads it: the TTL left at `now` (null: a pin), or null
    when there is none (released, or run out)."""
    if r is None or r.until <= now:
        return None
    return {"ttl_s": None if math.isinf(r.until) else r.until - now, "priority": r.priority}


def build_internal_router(state: ServerState, role: str, kv_remote: str | None) -> APIRouter:
    """The /internal routes; `kv_remote` tells the conductor whether blocks also go to a pool."""
    if role not in ROLES:
        raise InvalidRequest(f"role must be one of {ROLES}, got {role!r}", param="role")
    router = APIRouter(prefix="/internal", dependencies=[Depends(state.keys.cluster_key)])
    log = KVEventLog()
    boot_id = uuid.uuid4().hex

    @router.get("/state")
    async def instance_state(since: int = 0) -> dict:
        def read(engine: Any) -> tuple[Any, dict[str, int], str, int]:
            return engine.drain_kv_events(), engine.load_report(), engine.namespace, engine.block_size

        events, load, namespace, block_size = await state.engine.call(read)
        log.add(list(events.stored), list(events.evicted), events.retention)
        return {
            "boot_id": boot_id, "role": role, "model": state.model_name, "namespace": namespace,
            "block_size": block_size, "max_model_len": state.max_model_len, "kv_remote": kv_remote,
            "vocab_size": state.vocab_size, "system_fingerprint": system_fingerprint(state),
            "load": load, "cursor": log.cursor, **log.since(since, time.monotonic()),
        }

    @router.post("/generate")
    async def generate(req: CompletionRequest, raw: Request) -> StreamingResponse:
        req.check()
        prompt = req.prompt_list()
        if len(prompt) != 1 or not isinstance(prompt[0], list) or req.n != 1 or req.use_beam_search or req.echo:
            raise InvalidRequest("/internal/generate takes one token-id prompt, n=1, no beam search, no echo")
        if req.max_tokens is None:
            raise InvalidRequest("/internal/generate needs max_tokens", param="max_tokens")
        params = req.sampling_params(req.max_tokens, req.logprobs, req.prompt_logprobs)
        params.retention = completion_retention(req.kvpool_retention, prompt, state.tokenizer, True)
        if role == "decode" and not await state.engine.call(
                lambda e: e.decode_accepts(len(prompt[0]), params.max_tokens)):
            raise Overloaded("this decode instance cannot hold the request's KV now")  # the simulator's rule
        rid = state.engine.new_request_id("int")
        stream = await state.engine.submit(rid, prompt, params, time.monotonic(), req.cache_salt)
        return StreamingResponse(_lines(stream), media_type="application/x-ndjson")

    return router


async def _lines(stream: AsyncIterator) -> AsyncIterator[str]:
    """One JSON line per engine delta: new token ids, new text, the finish reason, and the new
    tokens' logprobs and top-N when asked (JSON floats round-trip exactly)."""
    cursor = Cursor()
    prompt: dict[str, Any] = {}  # the prompt's logprobs, from the request's first record
    try:
        async for _, out in stream:
            if out.prompt_logprobs is not None and not prompt:
                prompt = {"prompt_logprobs": out.prompt_logprobs, "prompt_top_logprobs": out.prompt_top_logprobs}
            if not out.outputs:
                continue
            c = out.outputs[0]
            first = cursor.tokens_sent
            cursor.advance(c)
            line = {"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason, "num_cached_tokens": out.num_cached_tokens,
                    "prompt_tokens": len(out.prompt_token_ids)}
            if c.logprobs is not None:
                line["logprobs"], line["top_logprobs"] = c.logprobs, c.top_logprobs
            if first == 0:  # the prompt's KV sources, for the conductor's usage; its logprobs
                line["kv_breakdown"] = kv_breakdown([out])
                line.update(prompt)
            yield json.dumps(line, ensure_ascii=False) + "\n"
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        yield json.dumps(classify(e)[1]) + "\n"
