"""Contiguous-KV baselines for the memory-waste analysis: reservation policies on a buddy arena.

Systems before PagedAttention gave each request one contiguous KV region sized up front.
`ContiguousKVManager` reproduces that so the same workload can be replayed against paged
allocation and the slots broken down the way the vLLM paper does: token states, reservation,
internal fragmentation, external fragmentation and free. Pure Python; a slot is one token's KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvpool.errors import ConfigError, InvalidRequest, KVPoolError, OutOfBlocks, UnknownSequence


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(slots=True, frozen=True)
class Allocation:
    """A contiguous run of `size` slots (a power of two) starting at `offset`."""

    offset: int
    size: int


class BuddyAllocator:
    """Binary buddy allocator over `num_slots` slots.

    An arena that is not a power of two is tiled by its binary decomposition, largest first
    (15,800 slots = 8,192 + 4,096 + 2,048 + ...): each tile is a root that never merges with
    its neighbour, so the whole KV budget is usable, as in the vLLM paper's Orca baselines.

    Invariant: the free blocks and the allocated blocks tile the arena without overlap, and
    no two free buddies of the same order inside one root coexist (they are always merged).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ConfigError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self.max_order = num_slots.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._roots: dict[int, int] = {}  # root offset -> order; each is aligned to its size
        offset = 0
        for order in range(self.max_order, -1, -1):
            if num_slots >> order & 1:
                self._roots[offset] = order
                self._free[order].add(offset)
                offset += 1 << order
        self._allocated: dict[int, int] = {}  # offset -> order

    def _root_order(self, offset: int) -> int:
        """Order of the root tile holding `offset` (roots are few: one per set bit)."""
        return next(k for o, k in reversed(self._roots.items()) if o <= offset)

    @property
    def free_slots(self) -> int:
        return sum(len(offsets) << order for order, offsets in enumerate(self._free))

    @property
    def allocated_slots(self) -> int:
        return sum(1 << order for order in self._allocated.values())

    def free_blocks(self) -> list[Allocation]:
        """Every free block, sorted by offset."""
        blocks = [Allocation(o, 1 << k) for k, offs in enumerate(self._free) for o in offs]
        return sorted(blocks, key=lambda b: b.offset)

    def allocated_blocks(self) -> list[Allocation]:
        return sorted(Allocation(o, 1 << k) for o, k in self._allocated.items())

    def largest_free_block(self) -> int:
        """Size of the largest free block, 0 when the arena is full."""
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def can_alloc(self, n: int) -> bool:
        return 1 <= n <= self.num_slots and self.largest_free_block() >= next_pow2(n)

    def alloc(self, n: int) -> Allocation:
        """Allocate `n` slots rounded up to a power of two; split larger blocks as needed.

        Raises OutOfBlocks when no free block of that order exists, even when the total free
        slots would suffice (external fragmentation).
        """
        if n < 1 or n > self.num_slots:
            raise InvalidRequest(f"allocation of {n} slots outside [1, {self.num_slots}]")
        order = (next_pow2(n)).bit_length() - 1
        found = next((k for k in range(order, self.max_order + 1) if self._free[k]), None)
        if found is None:
            raise OutOfBlocks(
                f"no free block of {1 << order} slots for a request of {n} "
                f"({self.free_slots} free, largest free block {self.largest_free_block()})"
            )
        offset = min(self._free[found])  # lowest address first: deterministic layout
        self._free[found].remove(offset)
        while found > order:
            found -= 1
            self._free[found].add(offset + (1 << found))
        self._allocated[offset] = order
        return Allocation(offset, 1 << order)

    def free(self, alloc: Allocation) -> None:
        """Return a block and merge it with its buddy while the buddy is free."""
        order = self._allocated.get(alloc.offset)
        if order is None or (1 << order) != alloc.size:
            raise InvalidRequest(f"{alloc} is not allocated (double free or foreign block)")
        del self._allocated[alloc.offset]
        offset = alloc.offset
        top = self._root_order(offset)
        while order < top:
            buddy = offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)


class ReservationPolicy(Protocol):
    """How many slots a contiguous system reserves for a request at admission."""

    name: str

    def reserve(self, prompt_len: int, max_len: int, final_len: int) -> int: ...


@dataclass(slots=True, frozen=True)
class MaxPolicy:
    """Reserve the model's maximum sequence length for every request (Orca 'Max')."""

    max_model_len: int = 2048
    name: str = "max"

    def reserve(self, prompt_len: int, max_len: int, final_len: int) -> int:
        return self.max_model_len


@dataclass(slots=True, frozen=True)
class Pow2Policy:
    """Reserve the prompt plus the output length rounded up to a power of two: at most twice
    the output (vLLM paper's Orca (Pow2): a 25-token output reserves 32 slots), capped at the
    request's maximum."""

    name: str = "pow2"

    def reserve(self, prompt_len: int, max_len: int, final_len: int) -> int:
        return max(min(prompt_len + next_pow2(max(final_len - prompt_len, 1)), max_len), final_len)


@dataclass(slots=True, frozen=True)
class OraclePolicy:
    """Reserve exactly the final length, which only an oracle knows (Orca 'Oracle')."""

    name: str = "oracle"

    def reserve(self, prompt_len: int, max_len: int, final_len: int) -> int:
        return final_len


@dataclass(slots=True)
class _Resident:
    alloc: Allocation
    length: int
    final_len: int


@dataclass(slots=True, frozen=True)
class ContiguousUsage:
    """Slot breakdown at one instant; the five parts sum to `total`.

    - token_slots: slots holding a token's KV now.
    - reserved_slots: slots kept for tokens the request has yet to generate (final - current).
    - internal_frag_slots: slots of an allocation that will never hold a token
      (allocation size - final length; includes the buddy round-up).
    - external_frag_slots: free slots that cannot be used for the next request: with
      `next_request_slots` given, the free slots in blocks smaller than that request's
      rounded size; otherwise every free slot outside the single largest free block.
    - free_slots: the remaining free slots (usable).
    """

    token_slots: int
    reserved_slots: int
    internal_frag_slots: int
    external_frag_slots: int
    free_slots: int
    total: int

    def fraction(self, part: str) -> float:
        return getattr(self, part) / self.total


class ContiguousKVManager:
    """Admits requests into one contiguous buddy-allocated region sized by `policy`."""

    def __init__(self, num_slots: int, policy: ReservationPolicy) -> None:
        self.arena = BuddyAllocator(num_slots)
        self.policy = policy
        self._seqs: dict[str, _Resident] = {}

    def _size(self, prompt_len: int, max_len: int, final_len: int) -> int:
        if not 1 <= prompt_len <= final_len <= max_len:
            raise InvalidRequest(
                f"need 1 <= prompt_len ({prompt_len}) <= final_len ({final_len}) "
                f"<= max_len ({max_len})"
            )
        size = self.policy.reserve(prompt_len, max_len, final_len)
        if size < final_len:
            raise InvalidRequest(
                f"policy {self.policy.name} reserves {size} slots < final_len {final_len}"
            )
        return size

    def can_admit(self, prompt_len: int, max_len: int, final_len: int) -> bool:
        return self.arena.can_alloc(self._size(prompt_len, max_len, final_len))

    def admit(self, req_id: str, prompt_len: int, max_len: int, final_len: int) -> Allocation:
        """Reserve the policy's region and store the prompt; OutOfBlocks leaves state unchanged."""
        if req_id in self._seqs:
            raise InvalidRequest(f"request {req_id!r} is already admitted")
        alloc = self.arena.alloc(self._size(prompt_len, max_len, final_len))
        self._seqs[req_id] = _Resident(alloc, prompt_len, final_len)
        return alloc

    def append(self, req_id: str, num_tokens: int = 1) -> None:
        """Store newly generated tokens; a request never grows past its final length."""
        res = self._get(req_id)
        if res.length + num_tokens > res.final_len:
            raise InvalidRequest(
                f"request {req_id!r} would reach {res.length + num_tokens} tokens "
                f"> final_len {res.final_len}"
            )
        res.length += num_tokens

    def free(self, req_id: str) -> None:
        self.arena.free(self._get(req_id).alloc)
        del self._seqs[req_id]

    def _get(self, req_id: str) -> _Resident:
        try:
            return self._seqs[req_id]
        except KeyError:
            raise UnknownSequence(f"request {req_id!r} is not admitted") from None

    def usage(self, next_request_slots: int | None = None) -> ContiguousUsage:
        """The vLLM-style slot breakdown now (see ContiguousUsage for the definitions)."""
        tokens = sum(r.length for r in self._seqs.values())
        final = sum(r.final_len for r in self._seqs.values())
        allocated = sum(r.alloc.size for r in self._seqs.values())
        free_total = self.arena.free_slots
        if next_request_slots is None:
            usable = self.arena.largest_free_block()
        else:
            need = next_pow2(next_request_slots)
            usable = sum(b.size for b in self.arena.free_blocks() if b.size >= need)
        if allocated + free_total != self.arena.num_slots:
            raise KVPoolError(f"slot accounting broken: {allocated} + {free_total} != total")
        return ContiguousUsage(
            token_slots=tokens,
            reserved_slots=final - tokens,
            internal_frag_slots=allocated - final,
            external_frag_slots=free_total - usable,
            free_slots=usable,
            total=self.arena.num_slots,
        )
