"""What the engine reports per request and step: what is new since its last report (a delta),
one record per request; `OutputAccumulator` folds a request's deltas into its whole output
(what `LLM.generate` and a non-streamed response return)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.sched.metrics import RequestMetrics

__all__ = ["CompletionOutput", "FinishedOutputs", "OutputAccumulator", "RequestMetrics", "RequestOutput"]


@dataclass(slots=True)
class CompletionOutput:
    """One sample's new tokens and text (text that may still begin a stop string is held back
    until it cannot); the finish reason on its last delta. `cumulative_logprob` is the total so far."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's step: `outputs` holds the samples with something new (best_of and beam
    search report their chosen outputs whole, once, when the request finishes)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None
    # with SamplingParams.prompt_logprobs, in the request's first record only: per prompt token
    # (None for the first), and its top-N
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class _Parts:
    """One sample's deltas so far; text kept in pieces, joined once per `result()`."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    last: CompletionOutput | None = None


class OutputAccumulator:
    """A request's deltas folded into its whole output; each `add` costs its delta's size."""

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._parts: dict[int, _Parts] = {}
        self._prompt: tuple[list | None, list | None] = (None, None)

    def add(self, delta: RequestOutput) -> None:
        self._last = delta
        if delta.prompt_logprobs is not None:
            self._prompt = (delta.prompt_logprobs, delta.prompt_top_logprobs)
        for c in delta.outputs:
            p = self._parts.get(c.index)
            if p is None:
                p = self._parts[c.index] = _Parts(
                    logprobs=[] if c.logprobs is not None else None,
                    top_logprobs=[] if c.top_logprobs is not None else None)
            p.token_ids += c.token_ids
            if c.text:
                p.texts.append(c.text)
            if c.logprobs is not None and p.logprobs is not None:
                p.logprobs += c.logprobs
            if c.top_logprobs is not None and p.top_logprobs is not None:
                p.top_logprobs += c.top_logprobs
            p.last = c

    @property
    def finished(self) -> bool:
        return self._last is not None and self._last.finished

    def result(self) -> RequestOutput:
        """The whole output so far (the request's latest record with every delta's content)."""
        last = self._last
        assert last is not None, "no output added yet"
        outs = []
        for index in sorted(self._parts):
            p = self._parts[index]
            text = "".join(p.texts)
            if len(p.texts) > 1:
                p.texts[:] = [text]
            c = p.last
            outs.append(CompletionOutput(index, list(p.token_ids), text, c.finish_reason, c.stop_reason,
                                         c.cumulative_logprob, _copy(p.logprobs), _copy(p.top_logprobs)))
        return RequestOutput(last.request_id, last.prompt_token_ids, outs, last.finished, last.num_cached_tokens,
                             last.metrics, last.prompt, last.error, *self._prompt)


class FinishedOutputs:
    """Every request's deltas folded as they come; `add(records)` (one step's) returns the
    whole outputs of the requests that finished in it."""

    def __init__(self) -> None:
        self._open: dict[str, OutputAccumulator] = {}

    def add(self, records: list[RequestOutput]) -> list[RequestOutput]:
        done = []
        for r in records:
            acc = self._open.get(r.request_id)
            if acc is None:
                acc = self._open[r.request_id] = OutputAccumulator()
            acc.add(r)
            if r.finished:
                done.append(self._open.pop(r.request_id).result())
        return done


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)
