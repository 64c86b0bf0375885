"""The engine's side of the tiered KV store: load external hits, save computed blocks.

The scheduler decides (at admission it asks `lookup` how many blocks beyond the device
prefix hit the store holds, and plans `KVLoad`s); this connector moves the bytes. Loads run
on store workers while the current step computes and land after it; the group computes
from the next step on. A block that fails to load is computed instead, so outputs never
depend on the store; a load still running after `load_timeout_s` is given up the same way, so
no tier, however stuck, holds the engine thread longer than that. Saves gather the blocks'
K/V on the engine
thread (their slots may be reused by the next step) and encode/write on store workers.
Write-through saves every block once its KV is computed; write-back saves a block only
when the device evicts it.

Layer-wise (`layerwise`): a landed load has only each block's header and per-layer table read
and checked (`overlapped_tiers`: host and disk, and Redis and Mooncake with `remote_layer_reads`;
a block in another tier is read and checked whole), and is reported as above; during the next forward pass a loader thread reads,
checks, decodes and writes its blocks one layer at a time (kvpool/engine/layerwise.py,
layer_reads.py), the model waiting for layer l before computing it; the plan is
kvpool/sched/layerwise.py's. A layer that fails there has already been attended to: the sequence
is rewound to the failed block after the forward (`Scheduler.rewind`: its row is dropped, its
tokens from there recomputed, a miss of reason `integrity`), the step's other rows unaffected.
Writes whose blocks the next step moves first (a swap-out or copy-on-write source) or that no
forward will run for are read and written whole before the step (rewound the same way).

Load or recompute (`plan_loads`): the connector is the scheduler's `LoadCosts`. It times every
forward pass against its tokens (the prefill cost, an online line) and hands the store's per-tier
read estimates to admission, which loads a hit only as far as that beats recomputing it
(kvpool/core/load_plan.py); with layer-wise reads the tiers read layer by layer under the forward
(`RangeReads`) are priced overlapped with the recompute, the others as read first. A tier not read
for `read_estimate_max_age_s` is priced as unknown (free), so a tier that was slow gets read, and
measured, again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

import numpy as np
import torch

from kvpool.core.block_pool import KVEvents
from kvpool.core.hashing import BlockHash
from kvpool.core.kv_groups import NO_BLOCK
from kvpool.core.load_plan import LinearEstimate, LoadEstimates
from kvpool.core.miss_reasons import INTEGRITY, LOAD_FAILED, MissLedger
from kvpool.engine.layer_reads import LayerReads
from kvpool.engine.layerwise import LayerwiseWriter
from kvpool.engine.runner import ModelRunner
from kvpool.sched.layerwise import LayerwisePlan, plan_layerwise
from kvpool.sched.scheduler import KVLoad, Scheduler, SchedulerOutput
from kvpool.store.disk import DiskTier
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.tier import RangeReads

logger = logging.getLogger(__name__)


class KVStoreConnector:
    def __init__(self, store: TieredKVStore, runner: ModelRunner, scheduler: Scheduler, write_policy: str,
                 load_timeout_s: float = 10.0, layerwise: bool = False, plan_loads: bool = True,
                 remote_layer_reads: bool = False) -> None:
        self.store = store
        self.layerwise = layerwise
        self.layerwise_reads = layerwise and runner.groups.num_groups == 1  # rewinds need one layer group
        self.load_timeout_s = load_timeout_s
        self.runner = runner
        self.scheduler = scheduler
        self.write_back = write_policy == "write-back"
        self._loaded: set[BlockHash] = set()
        self._held: set[BlockHash] = set()  # blocks the store was seen holding at admission: not saved again
        self._inflight: list[tuple[KVLoad, Future[list[np.ndarray]]]] = []
        self._pending_stored: list[BlockHash] = []
        self._staged: list[tuple[KVLoad, list[np.ndarray]]] = []  # checked, reported, not yet written
        self._writer: LayerwiseWriter | None = None
        self._reads: tuple[LayerReads, list[KVLoad], SchedulerOutput] | None = None  # the writer's
        self.last_layerwise: LayerwiseWriter | None = None  # the latest step's loader (its trace)
        self.loaded_blocks = 0
        self.failed_loads = 0
        self.rewound_loads = 0  # loads whose sequence was rewound: a layer failed under the forward
        self.timed_out_loads = 0
        self.saved_blocks = 0
        self.load_stall_s = 0.0  # engine-thread time spent waiting for loaded KV to be written
        self.read_wait_s = 0.0  # engine-thread time spent waiting for store reads (and checks) to finish
        self.read_estimate_max_age_s = 30.0
        self.prefill = LinearEstimate()  # seconds of a forward pass against its tokens
        self._forward: tuple[float, int] | None = None  # (start, tokens) of the forward under way
        self.block_bytes = math.prod(store.block_shape) * store.dtype.itemsize * runner.groups.num_groups
        # the tiers read layer by layer under the forward, which the planner prices overlapped: the
        # local ones; Redis and Mooncake only when asked (a round trip per block and layer: on
        # loopback here it cost more than it hid, docs/store.md)
        self.layer_read_tiers = frozenset(
            t.name for t in store.tiers
            if isinstance(t, RangeReads) and (remote_layer_reads or isinstance(t, HostTier | DiskTier)))
        if plan_loads:
            scheduler.admission.load_costs = self
        store.follow_retention(lambda: scheduler.kv.pool.retention)  # tiers honour the device's pins

    @property
    def overlapped_tiers(self) -> frozenset[str]:
        """The tiers whose hits are read layer by layer under the forward (none unless layer-wise)."""
        return self.layer_read_tiers if self.layerwise_reads else frozenset()

    def estimates(self) -> LoadEstimates | None:
        """The planner's inputs now (kvpool/core/load_plan.py); None until a forward pass was timed
        (the first, warming up, prices compute high: the planner errs towards loading)."""
        if self.prefill.count == 0:
            return None
        return LoadEstimates(self.store.read_costs(self.read_estimate_max_age_s), self.block_bytes,
                             self.prefill_s, overlap=self.overlapped_tiers,
                             first_forward_tokens=self.scheduler.config.prefill_chunk_tokens)

    def prefill_s(self, cached_tokens: int, new_tokens: int) -> float:
        """Estimated seconds to compute `new_tokens` prompt tokens: one step's fixed cost per chunk
        of the token budget, plus the per-token cost."""
        if new_tokens <= 0:
            return 0.0
        config = self.scheduler.config
        steps = math.ceil(new_tokens / config.max_num_batched_tokens) if config.enable_chunked_prefill else 1
        intercept, slope = self.prefill.line()
        return steps * intercept + slope * new_tokens

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.store.lookup(hashes)[0]

    def tiers_of(self, hashes: Sequence[BlockHash]) -> list[str]:
        """The fastest tier holding each of `hashes` (a run the store holds whole). Those blocks
        are not saved again when computed (the planner may recompute blocks the store holds)."""
        where = self.store.lookup(hashes)[1]
        if len(self._held) > 1 << 16:
            self._held.clear()
        self._held.update(hashes[: len(where)])
        return where

    def miss_ledger(self) -> MissLedger:
        """The scheduler's KV manager's ledger of miss reasons, told of this store's tiers."""
        return MissLedger.of(self.scheduler.kv, [t.name for t in self.store.tiers], self.tiers_of)

    def before_forward(self, out: SchedulerOutput, events: KVEvents) -> None:
        """Start the loads planned this step (they land while the step computes) and save the
        blocks about to be overwritten (write-back). Runs after schedule(), before any write."""
        self._pending_stored.extend(events.stored)
        if self.write_back and events.evicted:
            self._save(list(zip(events.evicted, events.evicted_block_ids, strict=True)))
        self._start_layerwise(out)
        layered = self.overlapped_tiers  # empty unless layer-wise
        for load in out.kv_loads:
            self._inflight.append((load, self.store.load_async(load.hashes, self.layerwise, layered)))
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        self._forward = (time.monotonic(), tokens, self._store_wait_s()) if tokens else None

    def complete_loads(self) -> None:
        """Copy landed blocks into their device blocks and report them to the scheduler; a
        block that did not load is computed instead, so outputs never depend on the store."""
        inflight, self._inflight = self._inflight, []
        for load, future in inflight:
            start = time.perf_counter()
            try:
                blocks = future.result(timeout=self.load_timeout_s)
            except FutureTimeout:
                logger.warning("KV store load of %d blocks for sequence %d still running after %.1fs; "
                               "computing them instead", len(load.hashes), load.seq.seq_id, self.load_timeout_s)
                self.timed_out_loads += 1
                blocks = []
            self.read_wait_s += time.perf_counter() - start
            if not self.scheduler.kv_load_valid(load):
                continue  # aborted or preempted meanwhile: its blocks are no longer its own
            if blocks:
                if self.layerwise:
                    self._staged.append((load, blocks))
                else:
                    self._write(load.block_ids[: len(blocks)], blocks)
                self._loaded.update(load.hashes[: len(blocks)])
                self.loaded_blocks += len(blocks)
            if len(blocks) < len(load.hashes):
                self.failed_loads += len(load.hashes) - len(blocks)
                logger.warning("KV store returned %d of %d planned blocks for sequence %d; computing the rest",
                               len(blocks), len(load.hashes), load.seq.seq_id)
            corrupt = len(blocks) < len(load.hashes) and load.hashes[len(blocks)] in self.store.recent_corrupt
            self.scheduler.finish_kv_load(load, len(blocks), INTEGRITY if corrupt else LOAD_FAILED)

    def after_forward(self, ran: bool = True) -> None:
        """The forward pass ended (`ran`) or failed: wait until every layer has landed, so no
        block of the plan is read, swapped or reused half-written."""
        writer, self._writer = self._writer, None
        reads, self._reads = self._reads, None
        if writer is not None:
            self.runner.model.before_layer = None
            start = time.perf_counter()
            writer.join(check_waited=ran)
            self.load_stall_s += writer.stall_s + time.perf_counter() - start
        if reads is not None and ran:  # a failed forward fails its requests: nothing to rewind
            if writer is not None and writer.timed_out:  # a tier read hung: every load recomputes
                reads[0].give_up()
                self.timed_out_loads += len(reads[1])
            self._settle(*reads)
        forward, self._forward = self._forward, None
        if forward is not None and ran:  # compute alone: a slow tier's reads must not price recomputing
            start, tokens, waited = forward
            self.prefill.update(float(tokens), time.monotonic() - start - (self._store_wait_s() - waited))

    def _store_wait_s(self) -> float:
        """Seconds this connector has spent waiting for store reads and writing loaded blocks."""
        return self.read_wait_s + self.load_stall_s

    def _start_layerwise(self, out: SchedulerOutput) -> None:
        """Hand the loads staged since the last step to a loader thread for this forward. A load
        whose blocks this step copies first (swapped out with its group, or a copy-on-write
        source), or whose step has no forward, is written whole now; one whose sequence no longer
        holds its blocks (aborted or preempted since it was reported) is dropped."""
        staged, self._staged = self._staged, []
        swapped = dict(out.swap_out)
        copied = {src for src, _ in out.copies}
        now, layered = [], []
        for load, blocks in staged:
            ids = load.block_ids[: len(blocks)]
            table = self._table(load, len(blocks))
            if table is None:
                continue
            kept = _still_held(ids, table)
            if kept is not None:
                load, blocks = _only(load, blocks, kept)
                (now if out.is_empty or copied.intersection(load.block_ids) else layered).append((load, blocks))
                continue
            kept = _still_held([swapped.get(b, NO_BLOCK) for b in ids], table)
            if kept is not None:
                now.append(_only(load, blocks, kept))  # before the swap-out copies them to the host
        if now:
            reads = LayerReads(*self._plan(now), self.store)
            start = time.perf_counter()
            for layer in reads.plan.layers():
                self._write_layer(layer, *self._device_ids(reads.layer(layer)))
            self.load_stall_s += time.perf_counter() - start
            self._settle(reads, [load for load, _ in now], out)
        if not layered:
            return
        reads = LayerReads(*self._plan(layered), self.store)
        self._reads = (reads, [load for load, _ in layered], out)
        self._writer = LayerwiseWriter(reads.plan, lambda layer: self._device_ids(reads.layer(layer)),
                                       lambda layer, data: self._write_layer(layer, *data), self.runner.device,
                                       self.load_timeout_s)
        self.last_layerwise = self._writer
        self.runner.model.before_layer = self._writer.wait
        self._writer.start()

    def _device_ids(self, layer: tuple[list[int], list[np.ndarray]]) -> tuple[torch.Tensor, list[np.ndarray]]:
        ids, blocks = layer
        return torch.tensor(ids, dtype=torch.long, device=self.runner.device), blocks

    def _settle(self, reads: LayerReads, loads: list[KVLoad], out: SchedulerOutput) -> None:
        """The reads are over: a load whose block j failed has its sequence rewound to that block
        (its blocks from there are computed again, and saved again: the store dropped the bad one)."""
        reads.finish()
        B = self.scheduler.kv.block_size
        for i, (j, why) in reads.failed.items():
            load = loads[i]
            self.scheduler.rewind(load.group, load.seq, (load.start_block + j) * B, out, why)
            self._loaded.difference_update(load.hashes[j:])
            self._held.difference_update(load.hashes[j:])
            lost = sum(w.load == i for w in reads.plan.writes) - j
            self.loaded_blocks -= lost
            self.failed_loads += lost
            self.rewound_loads += 1

    def _plan(self, staged: list[tuple[KVLoad, list[np.ndarray]]]) -> tuple[LayerwisePlan, list[np.ndarray]]:
        groups = self.runner.groups
        plan = plan_layerwise([load for load, _ in staged], [len(b) for _, b in staged], len(self.runner.kv_slots),
                              groups.layer_slot if groups.num_groups > 1 else ())
        return plan, [staged[w.load][1][w.index] for w in plan.writes]

    def _table(self, load: KVLoad, n: int) -> list[int] | None:
        """The blocks the load's sequence holds now where its first `n` blocks were planned, in
        the load's layer group (None if the sequence is gone)."""
        kv = self.scheduler.kv
        if not kv.has_seq(load.seq.seq_id):
            return None
        return kv.block_tables(load.seq.seq_id)[load.layer_group][load.start_block : load.start_block + n]

    def after_update(self, events: KVEvents) -> None:
        """Write-through: save the blocks whose KV this step computed (not the ones it loaded)."""
        stored = self._pending_stored + events.stored
        self._pending_stored = []
        if self.write_back:
            return
        pool = self.scheduler.kv.pool
        todo = []
        for h in stored:
            if h in self._loaded or h in self._held:
                self._loaded.discard(h)
                self._held.discard(h)
                continue
            block_id = pool.lookup(h)
            if block_id is not None:
                todo.append((h, block_id))
        self._save(todo)

    def close(self) -> None:
        self.store.close()

    def _write(self, block_ids: list[int], blocks: list[np.ndarray]) -> None:
        """Every layer of `blocks` into the device blocks `block_ids` (the whole-block path)."""
        start = time.perf_counter()
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.runner.device)
        for layer in range(len(self.runner.kv_slots)):
            self._write_layer(layer, ids, [b[layer] for b in blocks])
        self.load_stall_s += time.perf_counter() - start

    def _write_layer(self, layer: int, ids: torch.Tensor, layers: list[np.ndarray]) -> None:
        """Block layer `layer`'s K and V of stored blocks (`layers`: each one's `[2, B, H, D]`) into
        device blocks `ids` (a block holds its layer group's layers, in the group_size shared slots)."""
        if not layers:
            return
        k, v = self.runner.kv_slots[layer]
        data = _from_store(torch.from_numpy(np.stack(layers)), k.dtype)  # [n, 2, B, H, D]
        data = data.to(k.device, k.dtype, non_blocking=True)
        k.index_copy_(0, ids, data[:, 0])
        v.index_copy_(0, ids, data[:, 1])

    def _save(self, items: list[tuple[BlockHash, int]]) -> None:
        if not items:
            return
        ids = torch.tensor([b for _, b in items], dtype=torch.long)
        per_layer = []
        for k, v in self.runner.kv_slots:
            idx = ids.to(k.device)
            per_layer.append(torch.stack((k.index_select(0, idx), v.index_select(0, idx)), dim=1))
        data = _to_store(torch.stack(per_layer, dim=1).cpu()).numpy()  # [n, L, 2, B, H, D]
        for (h, _), block in zip(items, data, strict=True):
            self.store.save_async(h, block)
        self.saved_blocks += len(items)


def _still_held(ids: list[int], table: list[int]) -> list[int] | None:
    """Which of the planned blocks `ids` the sequence still holds (`table`), or None if it holds
    another block anywhere (its blocks were taken back). A window group may have freed leading
    ones since (its hit settled short of the plan): those are left out, not written."""
    kept = [j for j, t in enumerate(table) if t != NO_BLOCK]
    if not kept or any(table[j] != ids[j] for j in kept):
        return None
    return kept


def _only(load: KVLoad, blocks: list[np.ndarray], kept: list[int]) -> tuple[KVLoad, list[np.ndarray]]:
    """The load and its blocks narrowed to the indices `kept`."""
    if len(kept) == len(blocks):
        return load, blocks
    return replace(load, block_ids=[load.block_ids[j] for j in kept], hashes=[load.hashes[j] for j in kept]), \
        [blocks[j] for j in kept]


def _to_store(t: torch.Tensor) -> torch.Tensor:
    """numpy has no bfloat16: such blocks travel as their uint16 bit pattern (the store's dtype)."""
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def _from_store(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    return t.view(torch.bfloat16) if cache_dtype == torch.bfloat16 else t
