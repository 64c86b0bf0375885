"""Per-request timing, recorded by the drivers (the engine in wall-clock seconds, the
simulator in virtual seconds) into one record."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.core.miss_reasons import PromptSources
from kvpool.core.retention import RetentionRequest


@dataclass(slots=True)
class FirstTokenPhases:
    """Where a request's time to its first token went inside its driver (seconds): the wait
    from its admission to the start of the first step that ran it, then, summed over the steps
    that ran it until it had a token, each step's phases. A step's phases are the whole step's
    (a prompt's forward shares its step with the batch's decode rows)."""

    queued: float
    schedule: float = 0.0
    prefill_compute: float = 0.0  # the model's forward (and KV loads around it)
    sample: float = 0.0
    postprocess: float = 0.0  # the core's bookkeeping: commit KV, forks, stops
    detokenize: float = 0.0  # the output processor's text and stop strings
    steps: int = 0

    def add_step(self, start: float, scheduled: float, forwarded: float, sampled: float, postprocessed: float,
                 detokenized: float) -> None:
        """One step's instants, in order: its start, and the end of each phase."""
        self.schedule += scheduled - start
        self.prefill_compute += forwarded - scheduled
        self.sample += sampled - forwarded
        self.postprocess += postprocessed - sampled
        self.detokenize += detokenized - postprocessed
        self.steps += 1


@dataclass(slots=True)
class RequestMetrics:
    """One request's timeline in its driver's clock (wall or virtual): arrival, first
    scheduled, each output step's instant, and completion. The engine and the simulator both
    record into it; the scheduler itself never reads a clock."""

    request_id: str
    arrival_s: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    finish_s: float | None = None
    rejected: bool = False
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    first_scheduled_s: float | None = None
    n_param: int = 1  # the request's n and max_tokens (the server's per-request histograms)
    max_tokens_param: int | None = None
    retention_param: tuple[RetentionRequest, ...] = ()  # what it asked to keep (the request log records it)
    prompt_sources: PromptSources | None = None  # where the prompt's KV came from, why the rest was computed
    added_s: float | None = None  # when the driver admitted it into its queue (after the front's work)
    phases: FirstTokenPhases | None = None  # its time to first token, by phase, once it has run

    def on_token(self, now: float, count: int = 1) -> None:
        """Record `count` tokens emitted at `now` (count > 1 for parallel samples / spec. decode)."""
        if count == 1:  # the simulator's every decode token
            self.token_times.append(now)
        else:
            self.token_times.extend([now] * count)

    def finish(self, now: float) -> None:
        self.finish_s = now

    @property
    def done(self) -> bool:
        return self.finish_s is not None and not self.rejected

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def tbt(self) -> np.ndarray:
        """Gaps between consecutive tokens (time between tokens), as an array: a run has millions."""
        return np.diff(self.token_times)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; 0 for single-token outputs."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def e2e(self) -> float:
        end = self.finish_s if self.finish_s is not None else self.token_times[-1]
        return end - self.arrival_s

    @property
    def normalized_latency(self) -> float:
        """End-to-end latency per output token (the vLLM paper's metric)."""
        return self.e2e / max(self.output_len, 1)


    # The names the server's metrics and the benchmarks read (vLLM's spelling).
    @property
    def arrival_time(self) -> float:
        return self.arrival_s

    @property
    def first_scheduled_time(self) -> float | None:
        return self.first_scheduled_s

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def finished_time(self) -> float | None:
        return self.finish_s
