"""Sequence ids, and sequences that share blocks: a sample's or a beam's fork shares every block
of its parent (copy-on-write on its next write); a pruned beam is dropped with its blocks."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.request import Sequence, SequenceGroup


class Forks:
    """Hands out sequence ids and forks sequences in the KV manager."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._seq_ids = itertools.count()

    def new(self, prompt_token_ids: Iterable[int]) -> Sequence:
        token_ids = list(prompt_token_ids)
        return Sequence(next(self._seq_ids), token_ids, len(token_ids))

    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence of `group` sharing every block of `parent`."""
        child = Sequence(
            next(self._seq_ids), list(parent.token_ids), parent.prompt_len, parent.num_computed_tokens,
            parent.status, cumulative_logprob=parent.cumulative_logprob,
            logprobs=list(parent.logprobs), top_logprobs=list(parent.top_logprobs),
        )
        self.kv.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        return child

    def drop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Remove a sequence from its group entirely (a pruned beam)."""
        if self.kv.has_seq(seq.seq_id):
            self.kv.free(seq.seq_id)
        group.seqs.remove(seq)
