"""Many plain decode steps' KV work in one pass (the simulator's decode leaps, sched/decode_leap.py).

Step by step, each sequence reserves one slot a step (`append_slots`), which takes a new block when
the slot is a block's first, and registers a block once its last slot is written (`commit`). Here
the steps' blocks are taken in one call and registered in one call, in the order the steps would
take and register them (step by step, sequences in batch order), so the pool gives the same
blocks, evicts the same victims and records the same events. That holds because no registration
can fail or succeed differently for having come before or after an eviction: the keys the steps
register are checked to be distinct and cached nowhere in the pool first, and evictions only
drop keys of idle blocks, never of these in-use ones. When that check fails (a placeholder token
stream repeated a block), nothing but the sequences' keys has changed and the caller takes the
steps one by one; they register the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.kv_manager import KVCacheManager


def leap_slots(kv: KVCacheManager, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]], steps: int) -> bool:
    """Reserve and commit `steps` plain decode steps' slots of every sequence `seq_ids` (each
    holding slots for all but its newest token, its full blocks registered, its last block
    private; `token_lists` hold every token the steps write), as `append_slots(seq, 1)` then
    `commit` of each full block, step by step, would. False, having only named the blocks
    the steps fill, when it cannot be done in one pass; the caller then takes the steps."""
    pool = kv.pool
    if kv.num_groups != 1 or kv.ledger is not None or pool.retention is not None:
        return False
    entries = [kv.seqs[s] for s in seq_ids]
    if any(e.on_host for e in entries):
        return False
    B, b = kv.block_size, len(entries)
    opens: list[int] = []  # events as step * b + position: sorted, they are in step order
    fills: list[int] = []
    for j, e in enumerate(entries):
        held = e.num_tokens  # step i writes slot held + i
        opens += range((-held) % B * b + j, steps * b, B * b)
        fills += range((-held - 1) % B * b + j, steps * b, B * b)
    opens.sort()
    filled: list[tuple[int, int]] = []  # (position, block index) of each block filled, in order
    if kv.enable_prefix_caching and fills:
        fills.sort()
        for event in fills:
            i, j = divmod(event, b)
            full = (entries[j].num_tokens + i + 1) // B
            kv.keys_upto(entries[j], token_lists[j], full)  # named as `commit` names them, in the same order
            filled.append((j, full - 1))
        keys = [entries[j].hashes[k] for j, k in filled]
        lookup = pool.lookup
        if len(set(keys)) < len(keys) or any(lookup(k) is not None for k in keys):
            return False
    blocks = pool.allocate(len(opens), by_id=False)  # the victims in order, as a block a step takes them
    tables = [e.tables[0] for e in entries]
    for event, block in zip(opens, blocks, strict=True):
        tables[event % b].append(block)
    for j, e in enumerate(entries):  # the slots: the last block topped up, then the new ones
        held, table = e.num_tokens, tables[j]
        new = -(-(held + steps) // B) - -(-held // B)
        left = steps
        if held % B:
            top = min(B - held % B, left)
            pool.add_tokens(table[len(table) - new - 1], top)
            left -= top
        for block in table[len(table) - new :]:
            pool.add_tokens(block, min(B, left))
            left -= B
        e.num_tokens = held + steps
    i = 0
    while i < len(filled):  # registered in step order, a call per run of one cache salt
        salt = entries[filled[i][0]].cache_salt
        k = i + 1
        while k < len(filled) and entries[filled[k][0]].cache_salt == salt:
            k += 1
        run = filled[i:k]
        pool.register_many([tables[j][x] for j, x in run], [entries[j].hashes[x] for j, x in run], salt)
        for j, x in run:
            entries[j].num_registered = x + 1
        i = k
    return True
