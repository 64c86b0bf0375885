"""KV computed elsewhere (a transfer from a prefill instance, a pull from a peer or a pool write)
lands in a manager's prefix cache, as a KV connector stores it: a sequence holding the blocks is
allocated (the prompt plus one token: every allocation leaves its last token to compute), its full
blocks committed, and freed, so they stay cached (evictable) in the manager's own order.

Measured (2026-12-04, docs/performance.md): a one-pass version of these three calls in the block
pool left the same state but no faster run; the cost is the evictions and hash-map updates the
blocks need either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_manager import KVCacheManager

RECEIVER_SEQ_ID = -1  # a sequence id no scheduler hands out


def receive(kv: KVCacheManager, hashes: Sequence[BlockHash]) -> int:
    """Cache the blocks named `hashes` in `kv`; returns blocks written (0 when memory is short:
    the receiver then recomputes). Token ids are irrelevant: the hashes are given."""
    n = len(hashes)
    if n == 0 or n + 1 > kv.num_free_blocks:
        return 0
    tokens = range(n * kv.block_size + 1)  # only its length is read: every full block's hash is given
    kv.allocate(RECEIVER_SEQ_ID, tokens, block_hashes=hashes)
    kv.commit(RECEIVER_SEQ_ID, tokens, n * kv.block_size)
    kv.free(RECEIVER_SEQ_ID)
    return n
