"""Requests as the scheduler sees them: a group of sequences sharing one prompt."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpool.core.hashing import BlockHash
from kvpool.core.miss_reasons import PromptSources
from kvpool.sched.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream. KV exists for token_ids[:num_computed_tokens]."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sample_index: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt (and, after a recompute, every known token) has KV."""
        return len(self.token_ids) - self.num_computed_tokens > 1


@dataclass(slots=True)
class BeamState:
    """A beam search's k best finished hypotheses so far: (normalized score, output ids,
    reason), best first; `improvable` turns False once no running beam can beat the worst."""

    finished: list[tuple[float, list[int], FinishReason]] = field(default_factory=list)
    improvable: bool = True


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """A request: its live sequences (n samples or beams) are scheduled and preempted together."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    prompt_hashes: list[BlockHash] | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled: bool = False
    num_bypassed: int = 0  # times passed over: later arrivals admitted first, steps sat out (waiting_order.py)
    forked: bool = False
    pending_kv_loads: set[int] = field(default_factory=set)  # external KV loads in flight (ids)
    prompt_sources: PromptSources | None = None  # where its prompt's KV came from (with a MissLedger)
    beam: BeamState | None = None  # a beam search's finished hypotheses (made for one)

    def __post_init__(self) -> None:
        if self.params.use_beam_search and self.beam is None:
            self.beam = BeamState()

    @property
    def prompt_token_ids(self) -> list[int]:
        seq = self.seqs[0]  # a group always keeps a sequence (beam pruning keeps the survivors)
        return seq.token_ids[: seq.prompt_len]

    @property
    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, on the scheduler's hot path; a copy all the same
            return seqs[:] if seqs[0].status is not SeqStatus.FINISHED else []
        return [s for s in seqs if s.status is not SeqStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)
