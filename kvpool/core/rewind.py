"""Taking a sequence's KV back to an earlier token: its KV from there on must not be used (a store
block failed its check while a forward was already reading it layer by layer), so the blocks from
there are taken out of the prefix cache and the sequence recomputes into them.

The blocks stay the sequence's: it still needs slots for those tokens, so nothing is allocated
and a rewind cannot run out of memory. Only their hashes go (no other prompt can match them); the
sequence registers them again once it has recomputed them. A swapped-out sequence's device copies
(cached since the swap-out) leave the cache and become free. A sliding-window group must
still hold the blocks a query at the rewind point reads (else the rewind raises, changing nothing).
A block shared with another sequence is unregistered for both: the driver rewinds every sequence
that read it. Pure: the driver says which tokens are bad and runs them again.
"""

from __future__ import annotations

from kvpool.core.kv_groups import NO_BLOCK
from kvpool.core.kv_manager import KVCacheManager
from kvpool.errors import KVStateError


def rewind(kv: KVCacheManager, seq_id: int, num_tokens: int) -> int:
    """The KV of sequence `seq_id`'s tokens from `num_tokens` on is bad: unregister every group's
    blocks from the one holding token `num_tokens` on. Returns how many were in the prefix cache."""
    seq = kv.seq(seq_id)
    if not 0 <= num_tokens <= seq.num_tokens:
        raise KVStateError(f"cannot rewind sequence {seq_id} to token {num_tokens}: it has {seq.num_tokens}")
    B = kv.block_size
    for g, dead in zip(kv.groups, seq.dead, strict=True):
        if g.window is not None and dead > max(0, num_tokens - g.window + 1) // B:
            raise KVStateError(f"cannot rewind sequence {seq_id} to token {num_tokens}: layer group {g.index} "
                               f"freed blocks its window there reads (the first {dead})")
    first = num_tokens // B
    if seq.on_host:  # its device blocks stayed cached when it swapped out; a swap-in registers its host copies
        lookup = kv.pool.lookup
        found = (lookup(key) for g in kv.groups for key in g.keys(seq.hashes[first : seq.num_registered]))
        ids = [b for b in found if b is not None]
    else:
        ids = [b for table in seq.tables for b in table[first:] if b != NO_BLOCK]
    seq.num_registered = min(seq.num_registered, first)
    return kv.pool.unregister(ids)
