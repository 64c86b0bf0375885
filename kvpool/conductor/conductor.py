"""The conductor: picks a (prefill, decode) pair per request, or rejects it (Mooncake's
global scheduler). Pure: time comes in as `now`, costs from a predictor, and it returns
decisions that the gateway (real instances) or the simulator (virtual time) carry out.

Between two load reports it keeps its own estimates: a routed request's uncached tokens sit
in its prefill instance's queue until `on_prefill_done`, and its predicted decode interval
sits on its decode instance until `on_decode_done`, so a burst is not all sent to one place.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.conductor.decode_view import DecodeView, decode_fit
from kvpool.conductor.index import POOL, GlobalKVIndex
from kvpool.conductor.predictor import StepTimePredictor
from kvpool.conductor.records import ConductorConfig, InstanceLoad, RouteDecision, RouteRequest
from kvpool.conductor.routing import (
    PrefillOption,
    cache_aware,
    estimate_options,
    kv_centric,
    least_load,
)
from kvpool.errors import ConfigError, InvalidRequest, UnknownSequence


@dataclass(slots=True)
class _Admitted:
    """A routed request until its decode ends or it is dropped."""

    prefill_id: str
    decode_id: str
    arrival: float
    uncached_tokens: int
    prefill_epoch: int
    max_tokens: int
    tbt: float
    ctx: int
    blocks: int
    start: float
    finish: float
    in_decode: bool = False
    prefill_done_at: float | None = None


@dataclass(slots=True)
class _PrefillView:
    """Reported queue plus what was routed here since that report and is not done yet."""

    reported: int = 0
    added: int = 0
    epoch: int = 0

    @property
    def queued(self) -> int:
        return self.reported + self.added


@dataclass(slots=True)
class ConductorStats:
    accepted: int = 0
    rejected_at_arrival: dict[str, int] = field(default_factory=dict)
    rejected_after_prefill: int = 0
    wasted_prefill_tokens: int = 0
    failed: int = 0
    completed: int = 0
    slo_met: int = 0
    pulls: int = 0
    pulled_blocks: int = 0


class Conductor:
    """An empty `decode_ids` means colocated instances: each decodes what it prefilled."""

    def __init__(
        self,
        prefill_ids: Sequence[str],
        decode_ids: Sequence[str],
        predictor: StepTimePredictor,
        config: ConductorConfig | None = None,
    ) -> None:
        if not prefill_ids:
            raise ConfigError("prefill_ids must name at least 1 instance, got none")
        self.config = config or ConductorConfig()
        self.predictor = predictor
        self.index = GlobalKVIndex()
        self.stats = ConductorStats()
        self._prefill_ids = list(dict.fromkeys(prefill_ids))
        self._decode_ids = list(dict.fromkeys(decode_ids))
        self._prefill = {p: _PrefillView() for p in self._prefill_ids}
        known = self._prefill_ids + self._decode_ids
        self._decode = {d: DecodeView() for d in dict.fromkeys(known)}
        self._down: set[str] = set()
        self._admitted: dict[str, _Admitted] = {}
        self._rng = random.Random(self.config.seed)
        self._rr_next = 0

    # -- instance state -------------------------------------------------------------

    def _check_known(self, instance_id: str) -> None:
        if instance_id not in self._decode:
            raise ConfigError(f"unknown instance {instance_id!r}; known: {sorted(self._decode)}")

    def update_load(self, instance_id: str, load: InstanceLoad) -> None:
        """Adopt a load report; requests routed before it are now part of it."""
        self._check_known(instance_id)
        view = self._prefill.get(instance_id)
        if view is not None:
            view.reported = load.queued_prefill_tokens
            view.added = 0
            view.epoch += 1
        self._decode[instance_id].on_report(load)

    def mark_down(self, instance_id: str) -> None:
        """Stop routing to `instance_id` and forget the blocks it held."""
        self._check_known(instance_id)
        self._down.add(instance_id)
        self.index.on_instance_down(instance_id)

    def mark_up(self, instance_id: str) -> None:
        self._check_known(instance_id)
        self._down.discard(instance_id)

    # -- routing ---------------------------------------------------------------------

    def route(self, req: RouteRequest, now: float) -> RouteDecision:
        self._validate(req)
        cfg = self.config
        candidates = [(i, p) for i, p in enumerate(self._prefill_ids) if p not in self._down]
        if not candidates:
            return self._reject("no_prefill_instance")
        match = self.index.prefix_match(req.block_hashes)
        queued = {p: v.queued for p, v in self._prefill.items()}
        threshold = cfg.replication_threshold if cfg.policy == "kv-centric" else None
        held = {inst: self.index.num_blocks(inst) for _, inst in candidates}
        busy = {inst: self._decode[inst].committed().requests for _, inst in candidates}
        retained = self.index.retained_match(req.block_hashes, now)
        options = estimate_options(req.prompt_len, match, candidates, queued, self.predictor, cfg.block_size,
                                   threshold, held, busy, cfg.pull_from_peers, retained)
        best_ttft = min(o.ttft for o in options)
        if cfg.ttft_slo_s is not None and best_ttft > cfg.ttft_slo_s:
            return self._reject("ttft_slo", best_ttft)
        chosen = self._pick_prefill(options)
        picked = self._pick_decode(req, chosen, now)
        if picked is None:
            return self._reject("decode_overloaded", chosen.ttft)
        decode_id, tbt = picked
        self._admit(req, chosen, decode_id, tbt, now)
        return RouteDecision(
            accepted=True,
            prefill_id=chosen.instance_id,
            decode_id=decode_id,
            predicted_ttft=chosen.ttft,
            cached_blocks=chosen.cached_blocks,
            pull_from=chosen.pull_from,
            pull_blocks=chosen.pull_blocks,
        )

    def _validate(self, req: RouteRequest) -> None:
        if req.request_id in self._admitted:
            raise InvalidRequest(f"request {req.request_id!r} is already routed", "request_id")
        if req.prompt_len < 1:
            raise InvalidRequest(f"prompt_len must be >= 1, got {req.prompt_len}", "prompt_len")
        if req.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
        full = req.prompt_len // self.config.block_size
        if len(req.block_hashes) > full:
            raise InvalidRequest(
                f"{len(req.block_hashes)} block hashes for a {req.prompt_len}-token prompt, "
                f"which has at most {full} full blocks of {self.config.block_size}",
                "block_hashes",
            )

    def _reject(self, reason: str, ttft: float = 0.0) -> RouteDecision:
        counts = self.stats.rejected_at_arrival
        counts[reason] = counts.get(reason, 0) + 1
        return RouteDecision(accepted=False, reason=reason, predicted_ttft=ttft)

    def _pick_prefill(self, options: list[PrefillOption]) -> PrefillOption:
        policy = self.config.policy
        if policy == "random":
            return self._rng.choice(options)
        if policy == "round-robin":
            n = len(self._prefill_ids)
            by_order = {o.order: o for o in options}
            while self._rr_next % n not in by_order:
                self._rr_next += 1
            chosen = by_order[self._rr_next % n]
            self._rr_next += 1
            return chosen
        if policy == "least-load":
            return least_load(options)
        if policy == "cache-aware":
            return cache_aware(options)
        return kv_centric(options)

    def _pick_decode(
        self, req: RouteRequest, chosen: PrefillOption, now: float
    ) -> tuple[str, float] | None:
        """The decode instance with the smallest predicted TBT with this request added, among
        those within the TBT SLO and KV capacity (unless rejection is "none"). Returns it
        with the TBT that sets the request's predicted decode interval."""
        cfg = self.config
        ids = self._decode_ids or [chosen.instance_id]
        at = now + chosen.ttft
        ctx, blocks = self._decode_footprint(req)
        best: tuple[bool, float, int, int, str, float] | None = None
        for order, d in enumerate(ids):
            if d in self._down:
                continue
            fit = decode_fit(self._decode[d], self.predictor, cfg.rejection, cfg.tbt_slo_s, ctx, blocks,
                             req.max_tokens, at)
            key = (not fit.fits, fit.tbt, fit.requests, order, d, fit.interval_tbt)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        overloaded, _, _, _, decode_id, interval_tbt = best
        if overloaded and cfg.rejection != "none":
            return None
        return decode_id, interval_tbt

    def _decode_footprint(self, req: RouteRequest) -> tuple[int, int]:
        """(mean context tokens, KV blocks at its longest) of `req` while it decodes."""
        ctx = req.prompt_len + req.max_tokens // 2
        return ctx, math.ceil((req.prompt_len + req.max_tokens) / self.config.block_size)

    def _admit(
        self, req: RouteRequest, chosen: PrefillOption, decode_id: str, tbt: float, now: float
    ) -> None:
        uncached = req.prompt_len - chosen.cached_blocks * self.config.block_size
        view = self._prefill[chosen.instance_id]
        view.added += uncached
        start = now + chosen.ttft
        ctx, blocks = self._decode_footprint(req)
        rec = _Admitted(
            prefill_id=chosen.instance_id,
            decode_id=decode_id,
            arrival=now,
            uncached_tokens=uncached,
            prefill_epoch=view.epoch,
            max_tokens=req.max_tokens,
            tbt=tbt,
            ctx=ctx,
            blocks=blocks,
            start=start,
            finish=start + req.max_tokens * tbt,
        )
        self._admitted[req.request_id] = rec
        self._decode[decode_id].add(rec.start, rec.finish, rec.ctx, rec.blocks)
        self.stats.accepted += 1
        if chosen.pull_from is not None:
            self.stats.pulls += 1
            self.stats.pulled_blocks += chosen.pull_blocks

    # -- bookkeeping from the drivers ----------------------------------------------------

    def _get(self, request_id: str) -> _Admitted:
        rec = self._admitted.get(request_id)
        if rec is None:
            raise UnknownSequence(f"request {request_id!r} is not routed (or already finished)")
        return rec

    def _leave_prefill_queue(self, rec: _Admitted) -> None:
        view = self._prefill[rec.prefill_id]
        if rec.prefill_epoch == view.epoch:
            view.added -= rec.uncached_tokens
        else:
            view.reported = max(0, view.reported - rec.uncached_tokens)
        rec.uncached_tokens = 0

    def on_prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished (first token out): the request now decodes for up to
        max_tokens x its predicted TBT."""
        rec = self._get(request_id)
        if rec.in_decode:
            return
        self._leave_prefill_queue(rec)
        old = (rec.start, rec.finish)
        rec.start, rec.finish = now, now + rec.max_tokens * rec.tbt
        rec.in_decode = True
        rec.prefill_done_at = now
        self._decode[rec.decode_id].start_decode(old, (rec.start, rec.finish), rec.ctx, rec.blocks)

    def _drop(self, request_id: str) -> _Admitted:
        rec = self._admitted.pop(request_id)
        if not rec.in_decode:
            self._leave_prefill_queue(rec)
        self._decode[rec.decode_id].remove(rec.start, rec.finish, rec.ctx, rec.blocks, rec.in_decode)
        return rec

    def on_decode_done(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        """The request finished. SLO met: TTFT (arrival to prefill done) within the TTFT SLO and
        mean time between its `output_tokens` (default max_tokens) within the TBT SLO."""
        rec = self._get(request_id)
        self._drop(request_id)
        self.stats.completed += 1
        first = rec.prefill_done_at if rec.prefill_done_at is not None else now
        cfg = self.config
        ok = cfg.ttft_slo_s is None or first - rec.arrival <= cfg.ttft_slo_s
        n = output_tokens if output_tokens is not None else rec.max_tokens
        if cfg.tbt_slo_s is not None and n > 1:
            ok = ok and (now - first) / (n - 1) <= cfg.tbt_slo_s
        if ok:
            self.stats.slo_met += 1

    def on_rejected_after_prefill(self, request_id: str, wasted_tokens: int) -> None:
        """Decode refused a prefilled request: its prefill work (`wasted_tokens`) was lost."""
        self._get(request_id)
        self._drop(request_id)
        self.stats.rejected_after_prefill += 1
        self.stats.wasted_prefill_tokens += wasted_tokens

    def on_failed(self, request_id: str) -> None:
        """An admitted request ended without completing (instance failure, client gone)."""
        self._get(request_id)
        self._drop(request_id)
        self.stats.failed += 1

    # -- views -------------------------------------------------------------------------

    def queued_prefill_tokens(self, instance_id: str) -> int:
        """The conductor's current estimate of `instance_id`'s prefill queue."""
        self._check_known(instance_id)
        view = self._prefill.get(instance_id)
        return view.queued if view is not None else 0

    def decode_load(self, instance_id: str, at: float) -> int:
        """Requests predicted to be decoding on `instance_id` at time `at`."""
        self._check_known(instance_id)
        return self._decode[instance_id].load_at(at).requests

    def snapshot(self, now: float | None = None) -> dict:
        """A JSON-ready view for the gateway's /cluster endpoint. Per decode instance:
        `decode_load` running or promised requests, `decoding_now` those predicted to be
        decoding at `now` (when given)."""
        s = self.stats
        instances = {}
        for inst, view in self._decode.items():
            entry: dict = {
                "up": inst not in self._down,
                "cached_blocks": self.index.num_blocks(inst),
                "reported": {
                    "queued_prefill_tokens": view.report.queued_prefill_tokens,
                    "running_decode_reqs": view.report.running_decode_reqs,
                    "free_kv_blocks": view.report.free_kv_blocks,
                    "total_kv_blocks": view.report.total_kv_blocks,
                },
                "tracked_requests": view.tracked,
            }
            if inst in self._prefill:
                entry["role"] = "prefill" if self._decode_ids else "colocated"
                entry["queued_prefill_tokens"] = self._prefill[inst].queued
            else:
                entry["role"] = "decode"
            entry["decode_load"] = view.committed().requests
            if now is not None:
                entry["decoding_now"] = view.load_at(now).requests
                entry["retained_blocks"] = self.index.num_retained(inst, now)
            instances[inst] = entry
        return {
            "policy": self.config.policy,
            "rejection": self.config.rejection,
            "ttft_slo_s": self.config.ttft_slo_s,
            "tbt_slo_s": self.config.tbt_slo_s,
            "in_flight": len(self._admitted),
            "pool_blocks": self.index.num_blocks(POOL),
            "indexed_blocks": len(self.index),
            "stats": {
                "accepted": s.accepted,
                "rejected_at_arrival": dict(s.rejected_at_arrival),
                "rejected_after_prefill": s.rejected_after_prefill,
                "wasted_prefill_tokens": s.wasted_prefill_tokens,
                "completed": s.completed,
                "slo_met": s.slo_met,
                "pulls": s.pulls,
                "pulled_blocks": s.pulled_blocks,
            },
            "instances": instances,
        }
