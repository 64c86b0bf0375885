"""Admission: a waiting group gets blocks for every live sequence, all or nothing, reusing
its device prefix-cache hit; blocks beyond that hit which the external store holds are planned
as loads (`KVLoad`) that the driver carries out and reports back. A part of `Scheduler` (a
mixin over its state)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.output import ExternalLookup, KVLoad, SchedulerOutput
from kvpool.sched.request import SeqStatus, SequenceGroup

if TYPE_CHECKING:
    from kvpool.sched.scheduler import SchedulerConfig


class Admission:
    """`Scheduler`'s admission and store-load bookkeeping."""

    config: SchedulerConfig
    kv: KVCacheManager
    external_kv: ExternalLookup | None
    num_external_hit_tokens: int
    _load_ids: itertools.count
    _watermark_blocks: int

    def _admit(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Allocate blocks for every live sequence of a waiting group, all or nothing; blocks
        beyond the device prefix hit that the external store holds are loaded, not computed."""
        kv = self.kv
        plans = []
        need = 0
        for seq in group.live_seqs:
            hashes = group.prompt_hashes if len(seq.token_ids) == seq.prompt_len else None
            if hashes is None:
                hashes = kv.prompt_hashes(seq.token_ids, group.cache_salt) if self.config.enable_prefix_caching else []
            # prompt logprobs need every prompt position computed: no prefix hit (recompute)
            hit = kv.match_prefix([] if group.params.prompt_logprobs is not None else hashes, len(seq.token_ids))
            need += kv.blocks_needed(len(seq.token_ids), hit)
            plans.append((seq, hashes, hit))
        if need > kv.num_free_blocks - self._watermark_blocks:
            return False
        B = self.config.block_size
        for i, (seq, hashes, hit) in enumerate(plans):
            # the first allocation may reuse its match; it may change what the others match
            cached = kv.allocate(seq.seq_id, seq.token_ids, group.cache_salt, hashes, hit if i == 0 else None)
            hit_blocks = cached // B
            limit = (len(seq.token_ids) - 1) // B
            external = 0
            # one group's table only: a layer-grouped model computes what the device misses
            if self.external_kv is not None and hit_blocks < min(limit, len(hashes)) \
                    and group.params.prompt_logprobs is None and kv.num_groups == 1:
                external = self.external_kv(hashes[hit_blocks:limit])
            if external:
                table = kv.block_table(seq.seq_id)
                load_id = next(self._load_ids)
                out.kv_loads.append(KVLoad(load_id, group, seq, hit_blocks,
                                           list(hashes[hit_blocks : hit_blocks + external]),
                                           table[hit_blocks : hit_blocks + external]))
                group.pending_kv_loads.add(load_id)
                self.num_external_hit_tokens += external * B
            seq.num_computed_tokens = cached + external * B
            seq.status = SeqStatus.RUNNING
            if group.num_preemptions == 0:
                group.num_cached_prompt_tokens = seq.num_computed_tokens
        return True

    def _unadmit(self, group: SequenceGroup, out: SchedulerOutput) -> None:
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
        return self.kv.block_table(seq.seq_id)[load.start_block : end] == load.block_ids

    def finish_kv_load(self, load: KVLoad, num_loaded: int) -> None:
        """A planned load landed with its first `num_loaded` blocks; the rest is computed."""
        load.group.pending_kv_loads.discard(load.load_id)
        if num_loaded < len(load.hashes):
            position = (load.start_block + num_loaded) * self.config.block_size
            load.seq.num_computed_tokens = min(load.seq.num_computed_tokens, position)
            self.num_external_hit_tokens -= (len(load.hashes) - num_loaded) * self.config.block_size
            if load.group.num_preemptions == 0:  # usage reports what was reused, not what was planned
                load.group.num_cached_prompt_tokens = min(load.group.num_cached_prompt_tokens, position)
