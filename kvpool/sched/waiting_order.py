"""Which waiting group is admitted next: first come first served, cache-aware, or shortest
prefill.

Cache-aware ordering (SGLang's longest-prefix-match idea, with a fairness bound): among the
first `window` (16) waiting groups, the one with the most prompt tokens already in the device
prefix cache goes first (ties: the earliest), so a request whose KV is resident starts before
its hit is evicted by the requests ahead of it, and a short remaining prefill reaches its first
token sooner. Shortest-prefill ordering counts the hit where it matters for a first token: the
group with the fewest prompt tokens left to compute (its prompt less its cached prefix) goes
first, shortest-job-first on the prefill work, so under a queue of mixed lengths a short or
mostly cached prompt does not wait out a long one's prefill (mean TTFT falls; a long prompt
waits longer, up to the bound). Under shortest-prefill a step that admitted short prompts also
leaves a long one (over 4x their work and over 256 tokens) to the next step: a step costs what
its tokens cost, so a cache hit admitted beside a miss would wait out the miss's whole prefill
for its first token (measured under fcfs: a 64-token hit at 545 ms beside a 1,088-token miss,
~50 ms alone). A prompt already part-computed (chunked) competes the same way: shorter waiting
prompts are admitted before its next chunk, and a step that admitted them leaves that chunk to
the next step when the prompt is long next to them, so a short prompt arriving during a long
prompt's prefill waits for the step in flight, not for every chunk left (`competes`). Either way
a group passed over `max_bypass` times (admissions ahead of it, steps its chunk sat out) is
admitted or run next whatever its hit, so no request waits without bound. Pure and clock-free:
the bound counts admissions and steps, not seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.request import Sequence, SequenceGroup

LONG_RATIO = 4  # shortest-prefill: a prompt with over this times a step's admitted work ...
LONG_MIN_TOKENS = 256  # ... and over this many tokens waits for the next step (`defers`)


class WaitingOrder:
    """Picks the next waiting group and keeps the bypass counts of the ones passed over."""

    def __init__(self, kv: KVCacheManager, hashes: Callable[[SequenceGroup, Sequence], list[BlockHash]],
                 policy: str = "fcfs", max_bypass: int = 8, window: int = 16) -> None:
        self.kv = kv
        self.hashes = hashes  # a group's prompt hashes, as admission computes them
        self.policy = policy  # fcfs | cache-aware | shortest-prefill (sched/config.py)
        self.max_bypass = max_bypass
        self.window = window
        self.num_reordered = 0  # admissions that went ahead of an earlier arrival

    def pick(self, waiting: deque[SequenceGroup], computing: set[BlockHash] | None = None) -> SequenceGroup | None:
        """The group to try next (the queue is not empty), or None when every candidate awaits
        blocks a running prompt is computing now (`computing`: their hashes; see `awaits`)."""
        head = waiting[0]
        if self.policy == "fcfs" or head.num_bypassed >= self.max_bypass or (len(waiting) == 1 and not computing):
            return head
        best, best_score = None, 0
        for i in range(min(len(waiting), self.window)):
            group = waiting[i]
            if group.num_bypassed >= self.max_bypass:
                return group if best is None else best  # an earlier arrival at its bound is owed the turn
            cached = self._cached_tokens(group)  # one prefix match per candidate, for both uses
            if computing and self.awaits(group, computing, cached):
                continue
            s = cached if self.policy == "cache-aware" else cached - len(group.seqs[0].token_ids)
            if best is None or s > best_score:
                best, best_score = group, s
        return best

    def computing(self, groups: Iterable[SequenceGroup]) -> set[BlockHash] | None:
        """The hashes of the prompt blocks running `groups` hold but have not computed yet (the
        ones `awaits` waits for); None under FCFS, which admits in arrival order regardless."""
        if self.policy == "fcfs" or not self.kv.enable_prefix_caching:
            return None
        block_size, hashes = self.kv.block_size, set()
        for group in groups:
            seq = group.seqs[0]
            if group.prompt_hashes and seq.num_computed_tokens < seq.prompt_len:
                hashes.update(group.prompt_hashes[seq.num_computed_tokens // block_size:])
        return hashes

    def awaits(self, group: SequenceGroup, computing: set[BlockHash], cached: int) -> bool:
        """Whether `group`'s next prompt block past its device hit is one a running prompt is
        computing now (the same tokens, the same salt): it waits for that hit rather than
        computing the block again beside it (cache-aware and shortest-prefill; within the bound)."""
        if not self.kv.enable_prefix_caching or group.params.prompt_logprobs is not None:
            return False
        seq = group.seqs[0]
        hashes = self.hashes(group, seq)
        if len(seq.token_ids) != seq.prompt_len or not hashes:
            return False
        block = cached // self.kv.block_size  # `cached`: its device hit (`_cached_tokens`)
        return block < len(hashes) and hashes[block] in computing

    def defers(self, group: SequenceGroup, admitted_work: int, work: int | None = None) -> bool:
        """Whether `group` waits for the next step because this one already admitted shorter
        prompts (`admitted_work`: the tokens they compute) that its long prefill (`work` tokens
        left; by default its whole prefill) would hold up. Not at its bypass bound: the later
        arrivals admitted ahead of it and the steps it sat out count against that."""
        if self.policy != "shortest-prefill" or not admitted_work or group.num_bypassed >= self.max_bypass:
            return False
        if work is None:
            work = self.prefill_work(group)
        return work > max(LONG_MIN_TOKENS, LONG_RATIO * admitted_work)

    def competes(self, group: SequenceGroup, waiting: deque[SequenceGroup]) -> int:
        """Shortest-prefill: the prompt tokens a running, part-computed `group` has left when
        it competes with the waiting ones for this step (they are offered the step first), else
        0 (it runs where it stands: another policy, nobody waiting, decoding, or at its bound)."""
        if self.policy != "shortest-prefill" or not waiting or group.num_bypassed >= self.max_bypass:
            return 0
        live = group.live_seqs
        if len(live) != 1:
            return 0
        left = len(live[0].token_ids) - live[0].num_computed_tokens
        return left if left > 1 else 0

    def prefill_work(self, group: SequenceGroup) -> int:
        """The tokens a waiting `group`'s admission would compute: its prompt less its device hit
        (the whole sequence of one recomputed after preemption). The fewest goes first."""
        return len(group.seqs[0].token_ids) - self._cached_tokens(group)

    def admitted(self, waiting: deque[SequenceGroup], group: SequenceGroup) -> None:
        """`group` leaves the queue: every earlier arrival it went ahead of is passed over once."""
        if waiting[0] is group:
            waiting.popleft()
            return
        self.num_reordered += 1
        for earlier in waiting:
            if earlier is group:
                break
            earlier.num_bypassed += 1
        waiting.remove(group)

    def _cached_tokens(self, group: SequenceGroup) -> int:
        """Prompt tokens of `group` the device prefix cache holds now (0 where hits are off)."""
        if not self.kv.enable_prefix_caching or group.params.prompt_logprobs is not None:
            return 0
        seq = group.seqs[0]
        if len(seq.token_ids) != seq.prompt_len:
            return 0  # recomputed after preemption: no preference (it is owed its turn anyway)
        return self.kv.match_prefix(self.hashes(group, seq), seq.prompt_len).num_tokens
