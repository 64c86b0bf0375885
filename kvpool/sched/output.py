"""What one step is (`SchedulerOutput`, from `Scheduler.schedule()`) and what the driver sampled
for it (`Sample`, handed back to `Scheduler.postprocess()`): the records between core and driver."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvpool.core.hashing import BlockHash
from kvpool.core.kv_records import CopyOp, SwapMap
from kvpool.core.store_hits import StoreRange
from kvpool.sched.request import Sequence, SequenceGroup


@dataclass(slots=True)
class ScheduledSeq:
    """Compute `num_new_tokens` of `seq` from position `start`; `samples` when the step
    reaches the end of its known tokens and so yields the next token. `num_samples` tokens
    are wanted from that row: n on the first sample of an n-sample group (the core forks
    it), else 1 (0 for a prefill chunk that does not sample). `rewound`: the driver found KV
    this row read bad (`Scheduler.rewind`): nothing of the row is committed or sampled."""

    group: SequenceGroup
    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    num_samples: int = 0
    rewound: bool = False


@dataclass(slots=True)
class KVLoad:
    """Blocks of `seq` to fill from the external KV store: `block_ids[i]` receives the block
    named `hashes[i]`; they cover tokens [start_block*B, ...) of layer group `layer_group`. The
    group computes nothing until the driver reports the load back (`finish_kv_load`), so the I/O
    overlaps a step."""

    load_id: int
    group: SequenceGroup
    seq: Sequence
    start_block: int
    hashes: list[BlockHash]
    block_ids: list[int]
    layer_group: int = 0  # whose table `block_ids` are in; `hashes` are that group's keys
    store_hit: StoreHit | None = None  # a layer-grouped model's: the sequence's loads across groups


@dataclass(slots=True)
class StoreHit:
    """One sequence's store hit over several layer groups (one `KVLoad` each): each reports
    here how many blocks landed; with the last, what the hit is worth is settled
    (`kvpool.core.store_hits.store_hit_blocks`)."""

    hit_blocks: int  # the device prefix hit it extends
    num_loads: int
    landed: list[tuple[StoreRange, int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: `scheduled[i]` computes with `block_tables[i]`; `copies` (copy-on-write) and
    the swaps happen before the forward pass; the rows that sample, in order, are `sampling`."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    group_block_tables: list[list[list[int]]] = field(default_factory=list)  # [group][i], layer-grouped models
    copies: list[CopyOp] = field(default_factory=list)
    swap_in: SwapMap = field(default_factory=list)
    swap_out: SwapMap = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling(self) -> list[ScheduledSeq]:
        return [s for s in self.scheduled if s.samples]


@dataclass(slots=True)
class Sample:
    """What the driver drew for one sampling row. `token_ids` holds `num_samples` tokens (index
    order: the row's own sequence first, then the samples the core forks from it), with their
    logprobs and, when the request asked for them, the top alternatives. A beam-search row
    gives `candidates` instead: its best continuations as (token, logprob), best first, at
    least `beam_candidates(group)` of them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    candidates: list[tuple[int, float]] | None = None


# The driver's output constraint (a grammar), told each appended token (group, seq, token):
# True when the constraint is complete with it, and so the core stops the sequence.
ConstraintHook = Callable[[SequenceGroup, Sequence, int], bool]

# How many of the given hashes, from the first, an external KV store holds.
ExternalLookup = Callable[[Seq[BlockHash]], int]
