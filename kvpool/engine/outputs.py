"""What the engine reports per request: cumulative outputs, so streaming takes deltas."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.sched.metrics import RequestMetrics

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]


@dataclass(slots=True)
class CompletionOutput:
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
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None
