"""Admission: a waiting group gets blocks for every live sequence, all or nothing, reusing
its device prefix-cache hit; blocks beyond that hit which the external store holds are planned
as loads (`KVLoad`) that the driver carries out and reports back, as far as loading them beats
recomputing them (`core/load_plan.py`, with the driver's `load_costs`)."""

from __future__ import annotations

import itertools

from kvpool.core.fit import largest_fitting
from kvpool.core.hashing import BlockHash
from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.kv_records import PrefixHit
from kvpool.core.load_plan import LoadCosts, plan_load
from kvpool.core.miss_reasons import LOAD_FAILED
from kvpool.core.store_hits import StoreRange, store_hit_blocks, store_plan
from kvpool.sched.output import ExternalLookup, KVLoad, SchedulerOutput, StoreHit
from kvpool.sched.request import SeqStatus, Sequence, SequenceGroup


class Admission:
    """Admission of waiting groups and the bookkeeping of their store loads."""

    def __init__(self, kv: KVCacheManager, enable_chunked_prefill: bool, watermark_blocks: int,
                 external_kv: ExternalLookup | None = None) -> None:
        self.kv = kv
        self.chunked = enable_chunked_prefill
        self.watermark_blocks = watermark_blocks
        self.external_kv = external_kv  # how many blocks, from the first, the external store holds
        self.load_costs: LoadCosts | None = None  # the driver's estimates; None: load every hit whole
        self.num_external_hit_tokens = 0
        self.num_recomputed_for_speed_tokens = 0  # store-held tokens the planner chose to compute
        self._load_ids = itertools.count()

    def admit(self, group: SequenceGroup, out: SchedulerOutput, chunk: int) -> int:
        """Allocate blocks for every live sequence of a waiting group, all or nothing; blocks
        beyond the device prefix hit that the external store holds are loaded, not computed.
        Returns the tokens the first prefill chunk may take (0: not admitted). A window group
        gets blocks only up to that chunk (`_window_upto`), `chunk` tokens or, where those do
        not fit, the most that do (a recomputed sequence's prompt can outgrow the first
        chunk's blocks); the scheduler reserves each later chunk's as it runs."""
        kv = self.kv
        B = self.kv.block_size
        plans = []
        for seq in group.live_seqs:
            hashes = self.hashes(group, seq)
            hit = self._match(group, seq, hashes)
            ranges, slower = self._store_ranges(group, seq, hashes, hit.num_tokens // B)
            seq_need = kv.blocks_needed(len(seq.token_ids), hit, self._window_upto(hit, ranges, chunk))
            if ranges and seq_need > kv.pool.num_blocks - self.watermark_blocks:
                ranges, slower = [], 0  # the hit's window groups alone would never fit: compute instead
            plans.append((seq, hashes, hit, ranges, slower))
        chunk = self._fitting_chunk(plans, chunk)
        if not chunk:
            return 0
        for i, (seq, hashes, hit, ranges, slower) in enumerate(plans):
            if i > 0:  # the allocations before may have changed what this one matches
                planned, hit = hit.num_tokens, self._match(group, seq, hashes)
                if hit.num_tokens != planned:
                    ranges, slower = self._store_ranges(group, seq, hashes, hit.num_tokens // B)
            if i == 0 and group.num_preemptions == 0 and kv.ledger is not None:  # before allocating evicts
                group.prompt_sources = kv.ledger.explain(
                    seq.token_ids, group.cache_salt, hashes, hit.num_tokens // B,
                    ranges[0].end - hit.num_tokens // B if ranges else 0,
                    kv.enable_prefix_caching and group.params.prompt_logprobs is None, slower)
            self.num_recomputed_for_speed_tokens += slower * B
            cached = kv.allocate(seq.seq_id, seq.token_ids, group.cache_salt, hashes, hit,
                                 upto=self._window_upto(hit, ranges, chunk))
            external = self._plan_store_loads(group, seq, hashes, cached // B, ranges, out)
            seq.num_computed_tokens = cached + external * B
            seq.status = SeqStatus.RUNNING
            if group.num_preemptions == 0:
                group.num_cached_prompt_tokens = seq.num_computed_tokens
        return chunk

    def hashes(self, group: SequenceGroup, seq: Sequence) -> list[BlockHash]:
        """The chained block hashes of `seq`'s tokens; a new sequence's are its prompt's,
        computed once and kept on the group (the waiting order reads them too)."""
        fresh = len(seq.token_ids) == seq.prompt_len  # else recomputed after preemption: prompt + output
        if fresh and group.prompt_hashes is not None:
            return group.prompt_hashes
        if not self.kv.enable_prefix_caching:
            return []
        hashes = self.kv.prompt_hashes(seq.token_ids, group.cache_salt)
        if fresh:
            group.prompt_hashes = hashes
        return hashes

    def _fitting_chunk(self, plans: list, chunk: int) -> int:
        """`chunk`, or with window groups the largest first chunk whose blocks fit the free
        pool (their blocks grow with the chunk, the others' do not); 0 if none does."""
        kv = self.kv
        free = kv.num_free_blocks - self.watermark_blocks

        def fits(c: int) -> bool:
            return sum(kv.blocks_needed(len(seq.token_ids), hit, self._window_upto(hit, ranges, c))
                       for seq, _, hit, ranges, _ in plans) <= free

        if not kv.windowed or not self.chunked:
            return chunk if fits(chunk) else 0
        return largest_fitting(fits, chunk)

    def _match(self, group: SequenceGroup, seq: Sequence, hashes: list[BlockHash]) -> PrefixHit:
        # prompt logprobs need every prompt position computed: no prefix hit (recompute)
        return self.kv.match_prefix([] if group.params.prompt_logprobs is not None else hashes, len(seq.token_ids))

    def _store_ranges(self, group: SequenceGroup, seq: Sequence, hashes: list[BlockHash],
                      hit_blocks: int) -> tuple[list[StoreRange], int]:
        """What the external store adds past a device hit of `hit_blocks`, per layer group, cut
        where the planner says recomputing the rest is faster than loading it; and how many of
        the held blocks that cut leaves to compute."""
        if self.external_kv is None or group.params.prompt_logprobs is not None:
            return [], 0
        B = self.kv.block_size
        limit = (len(seq.token_ids) - 1) // B
        ranges = store_plan(self.kv.groups, hashes, hit_blocks, limit, self.external_kv)
        est = self.load_costs.estimates() if self.load_costs is not None and ranges else None
        if est is None:
            return ranges, 0
        end = ranges[0].end
        tiers: list[str | None] = list(self.load_costs.tiers_of(hashes[hit_blocks:end]))[: end - hit_blocks]
        tiers += [None] * (end - hit_blocks - len(tiers))
        k = hit_blocks + plan_load(tiers, est, hit_blocks * B, len(seq.token_ids), B).blocks
        if k == end:
            return ranges, 0
        cut = store_plan(self.kv.groups, hashes, hit_blocks, k, self.external_kv) if k > hit_blocks else []
        return cut, end - (cut[0].end if cut else hit_blocks)

    def _window_upto(self, hit: PrefixHit, ranges: list[StoreRange], chunk: int) -> int | None:
        """Where a new sequence's window groups stop at admission: the first prefill chunk (of
        `chunk` tokens) past its hit (device and store). None (the whole prompt) without
        chunked prefill."""
        if not self.kv.windowed or not self.chunked:
            return None
        start = ranges[0].end * self.kv.block_size if ranges else hit.num_tokens
        return start + chunk

    def _plan_store_loads(self, group: SequenceGroup, seq: Sequence, hashes: list[BlockHash], hit_blocks: int,
                          ranges: list[StoreRange], out: SchedulerOutput) -> int:
        """Plan the loads of the store's blocks past the device hit (per layer group: a window
        group loads only the blocks its window reads); returns the blocks the hit gains."""
        if not ranges:
            return 0
        kv = self.kv
        tables = kv.block_tables(seq.seq_id)
        shared = StoreHit(hit_blocks, len(ranges)) if kv.num_groups > 1 else None
        for r in ranges:
            load_id = next(self._load_ids)
            out.kv_loads.append(KVLoad(load_id, group, seq, r.start, kv.group_keys(hashes[r.start : r.end], r.group),
                                       tables[r.group][r.start : r.end], r.group, shared))
            group.pending_kv_loads.add(load_id)
        gained = ranges[0].end - hit_blocks
        self.num_external_hit_tokens += gained * self.kv.block_size
        return gained

    def unadmit(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        out.kv_loads = [ld for ld in out.kv_loads if ld.group is not group]
        group.pending_kv_loads.clear()
        for seq in group.live_seqs:
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING

    def kv_load_valid(self, load: KVLoad) -> bool:
        """The blocks a load was planned into still belong to its sequence (it was not
        aborted or preempted meanwhile), so the driver may write them."""
        seq = load.seq
        if load.load_id not in load.group.pending_kv_loads or not self.kv.has_seq(seq.seq_id):
            return False
        end = load.start_block + len(load.block_ids)
        return self.kv.block_tables(seq.seq_id)[load.layer_group][load.start_block : end] == load.block_ids

    def finish_kv_load(self, load: KVLoad, num_loaded: int, why: str = LOAD_FAILED) -> None:
        """A planned load landed with its first `num_loaded` blocks; the rest is computed (`why`:
        the miss reason of the first one that did not land). A layer-grouped sequence's hit settles
        with its last load: at the point every group has what its queries read, the window groups'
        blocks behind it freed."""
        load.group.pending_kv_loads.discard(load.load_id)
        if num_loaded < len(load.hashes) and load.group.prompt_sources is not None:
            load.group.prompt_sources.short_reason = why
        B = self.kv.block_size
        hit = load.store_hit
        if hit is None:
            if num_loaded < len(load.hashes):
                self._settle_store_hit(load, (load.start_block + num_loaded) * B)
            return
        hit.landed.append((StoreRange(load.layer_group, load.start_block, load.start_block + len(load.hashes)),
                           num_loaded))
        if len(hit.landed) == hit.num_loads:
            position = store_hit_blocks(hit.hit_blocks, hit.landed) * B
            if position < load.seq.num_computed_tokens:
                self._settle_store_hit(load, position)
            self.kv.drop_behind(load.seq.seq_id, load.seq.num_computed_tokens)

    def rewind_store_hit(self, group: SequenceGroup, seq: Sequence, position: int, why: str) -> None:
        """A store hit `seq` already computes from turned out good only up to `position` (a block
        failed its check under the forward): it ends there, the rest a miss for reason `why`."""
        if group.prompt_sources is not None:
            group.prompt_sources.short_reason = why
        self._settle(group, seq, position)

    def _settle_store_hit(self, load: KVLoad, position: int) -> None:
        """The sequence's store hit ends at `position`: compute from there."""
        self._settle(load.group, load.seq, position)

    def _settle(self, group: SequenceGroup, seq: Sequence, position: int) -> None:
        self.num_external_hit_tokens -= seq.num_computed_tokens - position
        seq.num_computed_tokens = position
        if group.num_preemptions == 0:  # usage reports what was reused, not what was planned
            group.num_cached_prompt_tokens = min(group.num_cached_prompt_tokens, position)
            if group.prompt_sources is not None:
                group.prompt_sources.settle(position // self.kv.block_size)
