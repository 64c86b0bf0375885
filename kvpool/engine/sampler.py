"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Filters run on the whole [N, V] batch at once. A seeded row draws its noise from its own
torch.Generator, so its tokens do not depend on which other rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.errors import InvalidRequest

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class RowParams:
    """Sampling parameters of one logits row."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 (or 0) keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    num_logprobs: int = 0  # top-N alternatives to report; 0 reports none

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequest(f"temperature={self.temperature} must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p={self.top_p} must be in (0, 1]", "top_p")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p={self.min_p} must be in [0, 1]", "min_p")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k={self.top_k} must be -1 (off) or >= 0", "top_k")
        if self.num_logprobs < 0:
            raise InvalidRequest(f"num_logprobs={self.num_logprobs} must be >= 0", "logprobs")


@dataclass(slots=True)
class SamplingTensors:
    """Per-row parameters as [N] tensors (plus python flags that let a batch skip whole filters)."""

    temperature: Tensor
    top_k: Tensor  # vocab size where off
    top_p: Tensor
    min_p: Tensor
    greedy: Tensor  # bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(
        cls, params: list[RowParams], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        temps = [p.temperature for p in params]
        top_k = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        greedy = [t < _GREEDY_EPS for t in temps]
        return cls(
            temperature=torch.tensor(
                [1.0 if g else t for g, t in zip(greedy, temps, strict=True)], device=device
            ),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw logits at the chosen token
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, best first; None if none asked


def apply_filters(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Tempered logits with tokens outside top-k / top-p / min-p set to -inf."""
    logits = logits / t.temperature.unsqueeze(1)
    if t.any_top_k or t.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        drop = ranks >= t.top_k.unsqueeze(1)
        if t.any_top_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # keep a token while the mass before it < p
            drop |= mass_before >= t.top_p.unsqueeze(1)
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if t.any_min_p:
        probs = logits.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * t.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(logits: Tensor, params: list[RowParams]) -> SampleResult:
    """One token per row of `logits` [N, V] (float32)."""
    if logits.shape[0] != len(params):
        raise InvalidRequest(f"{logits.shape[0]} logits rows but {len(params)} sampling params")
    logits = logits.float()
    t = SamplingTensors.from_params(params, logits.shape[-1], logits.device)
    chosen = logits.argmax(-1)
    if not t.all_greedy:
        probs = apply_filters(logits, t).softmax(-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
        for i, p in enumerate(params):
            if p.generator is not None:
                noise[i].exponential_(generator=p.generator)
        drawn = (probs / noise).argmax(-1)
        chosen = torch.where(t.greedy, chosen, drawn)
    logprobs = logits.log_softmax(-1)
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(1)).squeeze(1)
    top: list[list[tuple[int, float]]] | None = None
    max_n = max(p.num_logprobs for p in params)
    if max_n:
        values, ids = logprobs.topk(max_n, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        top = [
            list(zip(ids[i][: p.num_logprobs], values[i][: p.num_logprobs], strict=True))
            for i, p in enumerate(params)
        ]
    return SampleResult(chosen.tolist(), chosen_lp.tolist(), top)
