"""The KV coordinator: per-sequence block tables over a BlockPool, PagedAttention's memory manager.
The scheduler asks; this decides which blocks hold which tokens and returns the data movements
(copy-on-write copies, swap plans) for a driver to perform. Contract (docs/architecture.md):
- a prompt of L tokens takes ceil(L/B) blocks, a decode token a new block only when the last one
  is full, so a sequence never wastes more than B-1 slots;
- `fork` shares every block; the first write into a shared, partially filled last block copies it
  (one CopyOp), the last holder writes in place;
- full blocks are registered by chained hash once their KV is computed (`commit`), stay cached
  after their sequence ends, and are reused from the first block on by later prompts, which
  always recompute at least their last prompt token;
- every failed operation raises before changing any state.
A sequence has one block table per layer group (kvpool/core/layer_groups.py), all over the one shared pool;
a model without windows is one full-attention group. What an attention type changes (how far a hit reaches,
what an admission takes, which blocks to give back) is asked of its group manager (core/kv_groups.py); store
hits are planned in core/store_hits.py, swaps in core/swap.py, why a block missed in core/miss_reasons.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvpool.core.block_pool import BlockPool, KVEvents
from kvpool.core.fit import largest_fitting
from kvpool.core.hashing import BlockHash, hash_blocks, root_hash
from kvpool.core.kv_groups import NO_BLOCK, longest_hit, make_groups
from kvpool.core.kv_records import CopyOp, KVUsage, PrefixCacheStats, PrefixHit, SeqBlocks, SwapMap
from kvpool.core.miss_reasons import MissLedger
from kvpool.core.swap import HostBlockPool, swap_in, swap_out, unique_blocks
from kvpool.errors import ConfigError, KVStateError, OutOfBlocks, UnknownSequence


class KVCacheManager:
    """Block tables, prefix reuse, copy-on-write and swap plans for one device pool, over one
    group manager per layer group."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        num_host_blocks: int = 0,
        namespace: str = "",
        record_events: bool = False,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ConfigError(f"group_windows must be one window (>= 1 token, or None) per group, got {group_windows}")
        self.pool = BlockPool(num_blocks, block_size, eviction_policy, enable_prefix_caching, record_events)
        self.host = HostBlockPool(num_host_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self._root = root_hash(namespace)
        self.seqs: dict[int, SeqBlocks] = {}
        self.stats = PrefixCacheStats()
        self.num_cow_copies = 0
        self.group_windows: tuple[int | None, ...] = tuple(group_windows)
        self.groups = make_groups(self.group_windows, self.pool)
        self.num_groups = len(self.groups)
        self.windowed = any(w is not None for w in self.group_windows)
        self._window_groups = [g for g in self.groups if g.window is not None]
        self.ledger: MissLedger | None = None  # set by a driver that reports why blocks missed
        self.name_blocks = hash_blocks  # keys of blocks filled past the given ones (a driver may name its own)

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def seq(self, seq_id: int) -> SeqBlocks:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id} is not allocated (never allocated, or already freed)") from None

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def block_table(self, seq_id: int) -> list[int]:
        """Group 0's table (the live list: valid until the sequence's next change)."""
        return self.seq(seq_id).tables[0]

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """Every layer group's table (NO_BLOCK where a window group freed the block)."""
        return self.seq(seq_id).tables

    def blocks_held(self, seq_id: int) -> list[int]:
        """Blocks the sequence holds now, per layer group (freed window blocks excluded)."""
        seq = self.seq(seq_id)
        return [len(t) - d for t, d in zip(seq.tables, seq.dead, strict=True)]

    def max_blocks(self, prompt_len: int, total_len: int, chunk: int | None = None) -> int:
        """The most blocks a sequence of `prompt_len` prompt tokens growing to `total_len` ever
        holds at once, over all groups (window groups allocated per prefill chunk of `chunk`)."""
        return sum(g.max_blocks(prompt_len, total_len, chunk) for g in self.groups)

    def prompt_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                      limit: int | None = None) -> list[BlockHash]:
        """Chained hashes of the full blocks of `token_ids` (at most `limit` of them)."""
        return hash_blocks(token_ids, self.block_size, cache_salt=cache_salt, parent=self._root, limit=limit)

    def match_prefix(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> PrefixHit:
        """Longest run of cached blocks from block 0, leaving the last prompt token to compute:
        the largest k where every group holds what a query at k*B reads (`longest_hit`)."""
        if not self.enable_prefix_caching:
            return PrefixHit((), 0)
        limit = (num_prompt_tokens - 1) // self.block_size
        pool = self.pool
        if self.num_groups == 1 and not self.windowed:
            found = pool.lookup_run(hashes, limit)
            return PrefixHit((tuple(found),), len(found) * self.block_size, pool.count_idle(found))
        k = longest_hit(self.groups, hashes, 0, min(limit, len(hashes)), self._pool_run)
        lookup = pool.lookup
        tables = []
        for g in self.groups:
            first = g.first_needed(k)
            ids = list(map(lookup, g.keys(hashes[first:k])))
            tables.append((NO_BLOCK,) * first + tuple(ids))  # type: ignore[arg-type]
        live = [b for t in tables for b in t if b != NO_BLOCK]
        return PrefixHit(tuple(tables), k * self.block_size, pool.count_idle(live))

    def _pool_run(self, keys: Sequence[BlockHash]) -> int:
        return len(self.pool.lookup_run(keys, len(keys)))

    def group_keys(self, hashes: Sequence[BlockHash], group: int) -> list[BlockHash]:
        """Group `group`'s identities of the blocks named `hashes` (store keys, events)."""
        return list(self.groups[group].keys(hashes))

    def blocks_needed(self, num_tokens: int, hit: PrefixHit, upto: int | None = None) -> int:
        """New blocks an `allocate` of `num_tokens` with this prefix hit (and `upto`) takes from
        the free pool (cached hit blocks that are evictable leave the free pool too)."""
        cached = hit.num_tokens
        return sum(g.blocks_needed(num_tokens, cached, upto) for g in self.groups) + hit.idle_blocks

    def window_blocks_needed(self, seq_id: int, end: int) -> int:
        """New blocks `reserve(seq_id, end)` takes: window groups' blocks up to token `end`."""
        seq = self.seq(seq_id)
        return sum(g.reserve_needed(seq.tables[g.index], end, seq.num_tokens) for g in self._window_groups)

    def append_blocks_needed(self, seq_id: int, num_new_tokens: int = 1) -> int:
        seq = self.seq(seq_id)
        B = self.block_size
        tables = seq.tables
        need = -(-(seq.num_tokens + num_new_tokens) // B) - len(tables[0])
        if self.num_groups > 1:
            need *= self.num_groups
        if seq.num_tokens % B:
            ref = self.pool.ref_counts
            for t in tables:
                if ref[t[-1]] > 1:
                    need += 1  # copy-on-write of the shared partial last block
        return need

    def decode_steps(self, seqs: Sequence[tuple[int, int]], most: int) -> int:
        """How many plain decode steps, at most `most`, the sequences (seq_id, its token count)
        take without preempting, each step one token each: 0 unless every one has a slot for all
        but its newest token, its full blocks registered and no shared partial last block (no
        step copies). Reads the records directly: this runs once per batch over every running
        sequence on the simulator's hottest path, where a method call per sequence shows."""
        B = self.block_size
        caching = self.enable_prefix_caching
        entries, ref = self.seqs, self.pool.ref_counts
        slots: list[int] = []
        held = 0
        for seq_id, n in seqs:
            entry = entries[seq_id]
            filled = entry.num_tokens
            table = entry.tables[0]
            if filled != n - 1 or (caching and entry.num_registered != filled // B):
                return 0
            if filled % B and ref[table[-1]] > 1:
                return 0
            slots.append(filled)
            held += len(table)
        free = self.pool.num_free // self.num_groups  # every group's table grows alike (frees not counted on)
        return largest_fitting(lambda m: sum([-(-(n + m) // B) for n in slots]) - held <= free, most)

    def usage(self) -> KVUsage:
        return KVUsage.of(self.pool)

    # -- allocation ------------------------------------------------------------------------
    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        hit: PrefixHit | None = None,
        upto: int | None = None,
    ) -> int:
        """Give a new sequence slots for all of `token_ids`, reusing the longest cached
        prefix. Returns the number of tokens whose KV is already there (cached). `hit` is
        `match_prefix(block_hashes, len(token_ids))` when the caller has just taken it, with no
        change to this manager since (it saves walking a long prompt twice). With `upto`, window
        groups get slots only up to that token (rounded up to a block; `reserve` adds the rest
        chunk by chunk)."""
        if seq_id in self.seqs:
            raise KVStateError(f"sequence {seq_id} is already allocated")
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise KVStateError(f"sequence {seq_id} has no tokens to allocate")
        if block_hashes is None:
            block_hashes = self.prompt_hashes(token_ids, cache_salt) if self.enable_prefix_caching else []
        if hit is None:
            hit = self.match_prefix(block_hashes, num_tokens)
        pool = self.pool
        need = self.blocks_needed(num_tokens, hit, upto)
        if need > pool.num_free:
            raise OutOfBlocks(
                f"sequence {seq_id} needs {need} KV blocks for {num_tokens} tokens, "
                f"only {pool.num_free} of {pool.num_blocks} are free"
            )
        B = self.block_size
        cached = hit.num_tokens
        num_hit = cached // B
        hits = hit.tables  # one per group, or none at all
        for hit_ids in hits:  # every group's hit first: a new block must not evict another group's
            pool.incref_all([b for b in hit_ids if b != NO_BLOCK] if self.windowed else hit_ids)
        tables = []
        for g in self.groups:
            end = g.table_end(num_tokens, cached, upto)
            if hits:
                tables.append(list(hits[g.index]) + pool.allocate(-(-end // B) - num_hit, end - num_hit * B))
            else:
                tables.append(pool.allocate(-(-end // B), end))
        dead = [t.count(NO_BLOCK) for t in tables] if self.windowed else [0] * len(tables)
        self.seqs[seq_id] = SeqBlocks(tables, num_tokens, cache_salt, list(block_hashes), num_hit, dead=dead)
        self.stats.count(num_tokens, cached, B)
        return cached

    def reserve(self, seq_id: int, end: int) -> None:
        """Give the window groups slots up to token `end` (the end of the prefill chunk about to
        run): a sequence allocated with `upto` holds window blocks only for the chunks so far,
        and those behind the window are freed as chunks commit."""
        need = self.window_blocks_needed(seq_id, end)
        if not need:
            return
        if need > self.pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} KV blocks for its next chunk, "
                              f"only {self.pool.num_free} are free")
        seq = self.seqs[seq_id]
        if seq.on_host:
            raise KVStateError(f"sequence {seq_id} is swapped out; swap it in first")
        for g in self._window_groups:
            g.reserve(seq.tables[g.index], end, seq.num_tokens)

    def append_slots(self, seq_id: int, num_new_tokens: int = 1) -> list[CopyOp]:
        """Reserve slots for `num_new_tokens` more tokens; returns the copies to perform
        before writing (copy-on-write of a shared partial last block)."""
        seq = self.seqs.get(seq_id) or self.seq(seq_id)  # one call fewer per decode token
        B = self.block_size
        fill = seq.num_tokens % B
        if fill and fill + num_new_tokens <= B and not seq.on_host:
            ref = self.pool.ref_counts
            tables = seq.tables
            if self.num_groups == 1:
                last = tables[0][-1]
                if ref[last] == 1:  # the common decode step: room in a private last block
                    self.pool.add_tokens(last, num_new_tokens)
                    seq.num_tokens += num_new_tokens
                    return []
            elif all(ref[t[-1]] == 1 for t in tables):
                for t in tables:
                    self.pool.add_tokens(t[-1], num_new_tokens)
                seq.num_tokens += num_new_tokens
                return []
        if seq.on_host:
            raise KVStateError(f"sequence {seq_id} is swapped out; swap it in first")
        need = self.append_blocks_needed(seq_id, num_new_tokens)
        if need > self.pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} more KV blocks, only {self.pool.num_free} are free")
        copies: list[CopyOp] = []
        for table in seq.tables:
            self._grow(table, fill, num_new_tokens, copies)
        seq.num_tokens += num_new_tokens
        return copies

    def _grow(self, table: list[int], fill: int, num_new_tokens: int, copies: list[CopyOp]) -> None:
        """Extend one group's table by `num_new_tokens` slots (its last block holds `fill`)."""
        B = self.block_size
        pool = self.pool
        if fill:
            last = table[-1]
            if pool.ref_counts[last] > 1:
                (new,) = pool.allocate(1)
                pool.add_tokens(new, fill)
                pool.decref(last)
                table[-1] = new
                copies.append((last, new))
                self.num_cow_copies += 1
            take = min(B - fill, num_new_tokens)
            pool.add_tokens(table[-1], take)
            remaining = num_new_tokens - take
        else:
            remaining = num_new_tokens
        if remaining:
            table.extend(pool.allocate(-(-remaining // B), remaining))

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The KV of the first `num_computed_tokens` tokens is written: register the full blocks,
        then free the window groups' blocks no later query reads."""
        seq = self.seq(seq_id)
        if self.enable_prefix_caching:
            self._register(seq, token_ids, num_computed_tokens)
        if self.windowed and not seq.on_host:
            self._free_behind(seq, num_computed_tokens)

    def drop_behind(self, seq_id: int, num_computed_tokens: int) -> None:
        """A store hit settled at `num_computed_tokens`: free the window groups' blocks behind it."""
        seq = self.seq(seq_id)
        if self.windowed and not seq.on_host:
            self._free_behind(seq, num_computed_tokens)

    def _register(self, seq: SeqBlocks, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        B = self.block_size
        full = min(num_computed_tokens, seq.num_tokens) // B
        if seq.num_registered >= full:
            return
        hashes = self.keys_upto(seq, token_ids, full)
        start = seq.num_registered
        for g, table, dead in zip(self.groups, seq.tables, seq.dead, strict=True):
            ids, hs = table[start:full], g.keys(hashes[start:full])
            if dead > start:  # freed window blocks have nothing to register
                ids, hs = ids[dead - start :], hs[dead - start :]
            self.pool.register_many(ids, hs, seq.cache_salt)
        if self.ledger is not None:
            self.ledger.saw(hashes[start:full], token_ids, bool(seq.cache_salt), start)
        seq.num_registered = full

    def keys_upto(self, seq: SeqBlocks, token_ids: Sequence[int], full: int) -> list:
        """`seq`'s block keys through its first `full` blocks, naming the blocks filled since its
        last (decode, a partial prompt's tail) as `commit` registers them."""
        hashes = seq.hashes
        if len(hashes) < full:
            i = len(hashes)
            hashes += self.name_blocks(token_ids, self.block_size, cache_salt=seq.cache_salt,
                                       parent=hashes[-1] if i else self._root, start_block=i, limit=full)
        return hashes

    def _free_behind(self, seq: SeqBlocks, num_computed_tokens: int) -> None:
        dead = seq.dead
        for g in self._window_groups:
            i = g.index
            dead[i] = g.free_behind(seq.tables[i], dead[i], num_computed_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (no copy until a write)."""
        parent = self.seq(parent_id)
        if child_id in self.seqs:
            raise KVStateError(f"sequence {child_id} is already allocated")
        if parent.on_host:
            raise KVStateError(f"sequence {parent_id} is swapped out; cannot fork it")
        for t, d in zip(parent.tables, parent.dead, strict=True):
            self.pool.incref_all(t[d:])
        self.seqs[child_id] = SeqBlocks(
            [list(t) for t in parent.tables], parent.num_tokens, parent.cache_salt, list(parent.hashes),
            parent.num_registered, dead=list(parent.dead),
        )

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first so the least shareable are evicted first."""
        seq = self.seq(seq_id)
        del self.seqs[seq_id]
        for t, d in zip(seq.tables, seq.dead, strict=True):
            live = t[d:] if d else t
            if seq.on_host:
                for b in reversed(live):
                    self.host.decref(b)
            else:
                self.pool.release(reversed(live))

    def reset_prefix_cache(self, owned: Callable[[str | None], bool] | None = None) -> int:
        """Evict every cached block not in use, or only those whose cache_salt `owned` accepts."""
        return self.pool.evict_all_cached() if owned is None else self.pool.evict_cached_where(owned)

    def drain_events(self) -> KVEvents:
        return self.pool.drain_events()

    # -- swapping (kvpool/core/swap.py) ----------------------------------------------------------
    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return len(unique_blocks(self.seq, seq_ids, on_host=False)) <= self.host.num_free

    def can_swap_in(self, seq_ids: Iterable[int]) -> bool:
        return self.num_swap_in_blocks(seq_ids) <= self.pool.num_free

    def num_swap_in_blocks(self, seq_ids: Iterable[int]) -> int:
        """Device blocks swapping these host-resident sequences in takes (shared blocks once)."""
        return len(unique_blocks(self.seq, seq_ids, on_host=True))

    def swap_out(self, seq_ids: Sequence[int]) -> SwapMap:
        """Move a whole group to host slots, each shared block once; all or nothing."""
        unique = len(unique_blocks(self.seq, seq_ids, on_host=False))
        return swap_out([self.seqs[s] for s in seq_ids], unique, self.pool, self.host)

    def swap_in(self, seq_ids: Sequence[int]) -> SwapMap:
        """Bring a swapped group back to fresh device blocks; all or nothing."""
        unique = len(unique_blocks(self.seq, seq_ids, on_host=True))
        return swap_in([self.seqs[s] for s in seq_ids], unique, self.pool, self.host, self.groups)
