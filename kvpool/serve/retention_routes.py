"""Pin and unpin a prompt prefix (`POST /v1/kv/pin`, `/v1/kv/unpin`) and the retention metrics.

Scoped like `POST /reset_prefix_cache` (`KeyRing.admin_scope`): the `--admin-api-key` (or a
server without keys) acts in any namespace (`cache_salt` as given); a tenant's key acts in its
own namespace only (its salt joined with `cache_salt`, as its requests hash). A pin is a
retention (core/retention.py) on the full blocks of the prompt (or its first `prefix_tokens`):
with `ttl` ("30s", "5m", "1h", ...) it lapses then; without, it holds until unpinned. It holds by
content: blocks not cached yet are pinned when a request computes them.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Depends, FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from kvpool.core.retention import (
    MAX_TTL_S,
    RetentionRequest,
    pinned_blocks,
    release_prompt,
    retain_prompt,
)
from kvpool.engine.input_processor import check_token_ids
from kvpool.errors import InvalidRequest
from kvpool.serve.auth import Tenant, effective_salt
from kvpool.serve.retention_fields import parse_priority, parse_ttl
from kvpool.serve.state import ServerState


class PinRequest(BaseModel):
    """The body of both routes (unpin reads prompt, prefix_tokens, cache_salt and model)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | list[int] = Field(min_length=1)
    model: str | None = None
    prefix_tokens: int | None = Field(default=None, ge=1)
    ttl: str | None = None  # None: until unpinned
    priority: int = 0
    cache_salt: str | None = None
    add_special_tokens: bool = True


def _block_bytes(engine) -> int:
    """Bytes of one pool block (one layer group's layers)."""
    from kvpool.engine.kv_quant import bytes_per_token

    cfg = engine.loaded.config
    model_block = bytes_per_token(engine.kv_dtype, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) * engine.block_size
    return model_block // engine.scheduler.kv.num_groups


class RetentionCollector:
    """`kvpool:kv_pinned_bytes` (device blocks holding a live retention), and the counters
    `kvpool:kv_retention_ttl_expiries_total` and `kvpool:kv_pinned_evictions_total`."""

    def __init__(self, engine, model_name: str, prefix: str) -> None:
        self._engine, self._model, self._prefix = engine, model_name, prefix
        self._bytes = _block_bytes(engine)

    def collect(self):
        pool = self._engine.scheduler.kv.pool
        table = pool.retention
        gauge = GaugeMetricFamily(f"{self._prefix}:kv_pinned_bytes", "Bytes of cached device KV blocks holding a "
                                  "live retention (a pin or a cache_control TTL).", labels=["model_name"])
        gauge.add_metric([self._model], float(pinned_blocks(pool) * self._bytes))
        yield gauge
        for name, field, doc in (
            ("kv_retention_ttl_expiries", "num_ttl_expiries", "Block retentions whose TTL ran out."),
            ("kv_pinned_evictions", "num_pinned_evictions", "Retained device blocks evicted because nothing "
             "else could be."),
        ):
            fam = CounterMetricFamily(f"{self._prefix}:{name}", doc, labels=["model_name"])
            fam.add_metric([self._model], float(0 if table is None else getattr(table, field)))
            yield fam


def _recorder(state: ServerState):
    """The server's request log (`--record-requests`), or None."""
    return getattr(getattr(state.engine, "metrics", None), "recorder", None)


def install_retention(app: FastAPI, state: ServerState) -> None:
    """The pin routes behind the admin scope, and the collector on the server's registry."""
    keys = state.keys
    engine = getattr(state.engine, "engine", None)
    if engine is not None and hasattr(engine, "scheduler"):
        state.engine.metrics.registry.register(
            RetentionCollector(engine, state.model_name, state.engine.metrics.prefix))

    async def ids_and_salt(req: PinRequest, tenant: Tenant | None) -> tuple[list[int], str | None]:
        state.check_model(req.model)
        if isinstance(req.prompt, str):
            ids = await state.off_loop(state.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            check_token_ids(req.prompt, state.vocab_size, "prompt")
            ids = list(req.prompt)
        if req.cache_salt is not None and "\x00" in req.cache_salt:
            raise InvalidRequest("cache_salt may not contain NUL characters", param="cache_salt")
        return ids, effective_salt(tenant, req.cache_salt, "tenant")

    def scope(tenant: Tenant | None) -> str:
        return "server" if tenant is None else "tenant"

    @app.post("/v1/kv/pin")
    async def pin(req: PinRequest, tenant: Tenant | None = Depends(keys.admin_scope)) -> dict[str, Any]:  # noqa: B008
        ttl = None if req.ttl is None else parse_ttl(req.ttl, "ttl", MAX_TTL_S)
        retention = RetentionRequest(req.prefix_tokens, ttl, parse_priority(req.priority, "priority"))
        ids, salt = await ids_and_salt(req, tenant)
        now = time.monotonic()  # the driver's clock, as the engine's own steps use

        def apply(e) -> tuple[int, int]:
            kv = e.scheduler.kv
            held = retain_prompt(kv, ids, salt, retention, now)
            if (recorder := _recorder(state)) is not None:  # `serve --record-requests`: sim replay pins too
                recorder.record_pin(now, kv.prompt_hashes(ids, salt), retention)
            return held // kv.num_groups, pinned_blocks(kv.pool)

        blocks, pinned = await state.engine.call(apply)
        return {"pinned_blocks": blocks, "prompt_tokens": len(ids), "ttl_seconds": ttl,
                "priority": req.priority, "device_pinned_blocks": pinned, "scope": scope(tenant)}

    @app.post("/v1/kv/unpin")
    async def unpin(req: PinRequest, tenant: Tenant | None = Depends(keys.admin_scope)) -> dict[str, Any]:  # noqa: B008
        if req.ttl is not None or req.priority != 0:
            raise InvalidRequest("unpin takes no ttl or priority", param="ttl" if req.ttl is not None else "priority")
        ids, salt = await ids_and_salt(req, tenant)
        now = time.monotonic()

        def apply(e) -> int:
            kv = e.scheduler.kv
            if (recorder := _recorder(state)) is not None:
                recorder.record_unpin(now, kv.prompt_hashes(ids, salt), req.prefix_tokens)
            return release_prompt(kv, ids, salt, req.prefix_tokens) // kv.num_groups

        return {"unpinned_blocks": await state.engine.call(apply), "scope": scope(tenant)}
