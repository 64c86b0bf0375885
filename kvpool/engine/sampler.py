"""Batched token sampling: logit bias, penalties, banned tokens, grammar masks, greedy,
temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every processor runs on the whole [N, V] batch at once (token lists become count tensors by
one scatter). A seeded row draws its noise from its own torch.Generator, so its tokens do not
depend on which other rows share the batch. Reported logprobs are those of the raw model
logits (vLLM's default), whatever the processors did to choose the token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.engine.layers import fused_ops
from kvpool.errors import InvalidRequest

_GREEDY_EPS = 1e-5
LOGIT_BIAS_LIMIT = 100.0


@dataclass(slots=True)
class RowParams:
    """Sampling parameters of one logits row."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 (or 0) keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    num_logprobs: int = 0  # top-N alternatives to report; 0 reports none
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence among generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: divides positive, multiplies negative logits of seen tokens
    logit_bias: Mapping[int, float] | None = None  # added to the logits, clamped to [-100, 100]
    banned_token_ids: Sequence[int] = ()  # never sampled this step (bad words whose prefix matched)
    prompt_ids: Sequence[int] = ()  # seen by the repetition penalty only
    output_ids: Sequence[int] = ()  # generated so far: every penalty

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

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
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty={self.repetition_penalty} must be > 0", "repetition_penalty")


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


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, V] int counts of each row's tokens, by one scatter over a padded [N, L] id tensor."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros((len(rows), vocab_size + 1), dtype=torch.int32, device=device)
    if width:
        ids = torch.full((len(rows), width), vocab_size, dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, dtype=torch.int32, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, params: list[RowParams]) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties, on a copy."""
    n, vocab = logits.shape
    device = logits.device
    out_counts = token_counts([p.output_ids for p in params], vocab, device)
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    if any(p.repetition_penalty != 1 for p in params):
        seen = (out_counts > 0) | (token_counts([p.prompt_ids for p in params], vocab, device) > 0)
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    return logits - freq * out_counts - pres * (out_counts > 0)


def apply_logit_bias(logits: Tensor, params: list[RowParams]) -> Tensor:
    """Adds each row's clamped bias at its token ids (one index_put over every (row, token))."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(tok)
            vals.append(min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT))
    if not rows:
        return logits
    idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(idx, torch.tensor(vals, device=logits.device), accumulate=True)


def ban_tokens(logits: Tensor, params: list[RowParams]) -> Tensor:
    rows = [i for i, p in enumerate(params) for _ in p.banned_token_ids]
    if not rows:
        return logits
    cols = [t for p in params for t in p.banned_token_ids]
    idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(idx, torch.tensor(float("-inf"), device=logits.device))


def process_logits(logits: Tensor, params: list[RowParams], allowed: Tensor | None = None) -> Tensor:
    """The logits tokens are chosen from: bias, penalties, banned tokens and the grammar mask
    (`allowed`, bool [N, V], False where a row's grammar forbids the token)."""
    logits = apply_logit_bias(logits, params)
    if any(p.penalized for p in params):
        logits = apply_penalties(logits, params)
    logits = ban_tokens(logits, params)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def sample(logits: Tensor, params: list[RowParams], allowed: Tensor | None = None) -> SampleResult:
    """One token per row of `logits` [N, V] (float32, or the model's bfloat16); `allowed` is an optional
    grammar mask."""
    if logits.shape[0] != len(params):
        raise InvalidRequest(f"{logits.shape[0]} logits rows but {len(params)} sampling params")
    max_n = max(p.num_logprobs for p in params)
    # An all-greedy batch with nothing to apply and no top-N is read by the native ops as it is:
    # bf16 logits are the float32 values they would become, so this only skips the [N, V] copy.
    as_is = fused_ops.takes_logits(logits) and allowed is None and max_n == 0 and all(
        p.temperature < _GREEDY_EPS and not (p.logit_bias or p.penalized or p.banned_token_ids) for p in params)
    raw = logits = logits if as_is else logits.float()
    logits = process_logits(logits, params, allowed)
    native = fused_ops.takes_logits(raw)  # by dtype and device alone: the same path for any batch
    chosen = fused_ops.argmax_rows(logits) if native else logits.argmax(-1)
    if not all(p.temperature < _GREEDY_EPS for p in params):  # an all-greedy batch needs no [N] tensors
        t = SamplingTensors.from_params(params, logits.shape[-1], logits.device)
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
    top: list[list[tuple[int, float]]] | None = None
    if native:  # the logprobs wanted, no [N, V] log_softmax
        chosen_lp = fused_ops.log_softmax_at(raw, chosen.unsqueeze(1)).squeeze(1)
        if max_n:
            ids = raw.topk(max_n, dim=-1).indices
            values = fused_ops.log_softmax_at(raw, ids)
    else:
        logprobs = raw.log_softmax(-1)
        chosen_lp = logprobs.gather(-1, chosen.unsqueeze(1)).squeeze(1)
        if max_n:
            values, ids = logprobs.topk(max_n, dim=-1)
    if max_n:
        values, ids = values.tolist(), ids.tolist()
        top = [
            list(zip(ids[i][: p.num_logprobs], values[i][: p.num_logprobs], strict=True))
            for i, p in enumerate(params)
        ]
    return SampleResult(chosen.tolist(), chosen_lp.tolist(), top)


def bad_word_bans(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output (vLLM's `bad_words`):
    a one-token word is always banned, a longer one only where it would be completed."""
    banned = []
    for word in bad_words:
        prefix = list(word[:-1])
        if not prefix or (len(output_ids) >= len(prefix) and list(output_ids[-len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned
