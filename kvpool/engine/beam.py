"""Beam search over forked sequences: beams that share history share KV blocks.

Follows HF transformers' beam search (early_stopping=False) so results can be compared
token for token: each step keeps the best `k` of max(2, 1 + #eos) * k continuations;
continuations ending in EOS (or at max_tokens) among the top k become finished hypotheses
scored sum(logprob) / generated_len ** length_penalty; the search stops when no running beam
can beat the worst of k finished hypotheses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpool.sched.request import FinishReason, Sequence, SequenceGroup
from kvpool.sched.scheduler import Scheduler


@dataclass(slots=True)
class BeamState:
    finished: list[tuple[float, list[int], FinishReason]] = field(default_factory=list)
    improvable: bool = True


def beam_step(
    sched: Scheduler, group: SequenceGroup, state: BeamState, beams: list[Sequence], logits: Tensor
) -> None:
    """Advance one group by one token given its live beams' logits rows."""
    params = group.params
    k = params.n
    eos = () if params.ignore_eos else group.eos_token_ids
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    cum = torch.tensor([b.cumulative_logprob for b in beams], dtype=logprobs.dtype)
    acc = (logprobs + cum[:, None]).reshape(-1)
    vocab = logprobs.shape[-1]
    scores, idx = torch.topk(acc, min(max(2, 1 + len(eos)) * k, acc.numel()))
    gen_len = beams[0].num_output_tokens + 1
    at_limit = gen_len >= params.max_tokens
    running: list[tuple[Sequence, int, float]] = []
    for rank, (score, flat) in enumerate(zip(scores.tolist(), idx.tolist(), strict=True)):
        parent, token = beams[flat // vocab], flat % vocab
        hits = token in eos or at_limit
        if hits:
            if rank < k and state.improvable:
                reason = FinishReason.STOP if token in eos else FinishReason.LENGTH
                norm = score / gen_len**params.length_penalty
                state.finished.append((norm, parent.output_ids + [token], reason))
        elif len(running) < k:
            running.append((parent, token, score))
    state.finished.sort(key=lambda h: -h[0])
    del state.finished[k:]
    if running and len(state.finished) == k:
        best = running[0][2] / gen_len**params.length_penalty
        state.improvable = best > state.finished[-1][0]
    if not running or not state.improvable:
        for b in beams:
            sched.finish_seq(group, b, FinishReason.STOP)
        return
    _apply(sched, group, beams, running)


def _apply(sched: Scheduler, group: SequenceGroup, beams: list[Sequence], running) -> None:
    """Reuse each parent for its first child, fork it for the others, drop unused parents."""
    used: set[int] = set()
    targets = []
    for parent, token, score in running:
        child = sched.fork(group, parent) if parent.seq_id in used else parent
        used.add(parent.seq_id)
        targets.append((child, token, score))
    for b in beams:
        if b.seq_id not in used:
            sched.drop_seq(group, b)
    for seq, token, score in targets:
        seq.token_ids.append(token)
        seq.cumulative_logprob = score
