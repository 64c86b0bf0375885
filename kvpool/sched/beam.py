"""Beam search over forked sequences, in the core: beams that share history share KV blocks.

Follows HF transformers' beam search (early_stopping=False) so that the engine's results can be
compared token for token: each step keeps the best `k` of max(2, 1 + #eos) * k continuations;
continuations ending in EOS (or at max_tokens) among the top k become finished hypotheses
scored sum(logprob) / generated_len ** length_penalty; the search stops when no running beam
can beat the worst of k finished hypotheses. The driver supplies each beam's best
continuations (the engine from the model's logits, the simulator from a seeded stand-in);
the selection, forks and prunes happen here, once for both.
"""

from __future__ import annotations

from kvpool.sched.forks import Forks
from kvpool.sched.request import FinishReason, Sequence, SequenceGroup
from kvpool.sched.stops import Stops

Candidates = list[tuple[int, float]]  # a beam's continuations (token, logprob), best first


def beam_candidates(group: SequenceGroup) -> int:
    """Continuations each beam must offer: enough that the best k survive any EOS among them."""
    eos = () if group.params.ignore_eos else group.eos_token_ids
    return max(2, 1 + len(eos)) * group.params.n


class BeamSearch:
    """Beam steps over forked sequences: forks and drops through `forks`, finishes through `stops`."""

    def __init__(self, forks: Forks, stops: Stops) -> None:
        self.forks = forks
        self.stops = stops

    def step(self, group: SequenceGroup, rows: list[tuple[Sequence, Candidates]]) -> int:
        """Advance one group by one token from its live beams' candidates; returns the tokens
        appended (the kept continuations)."""
        state = group.beam
        assert state is not None, "a beam step on a group without beam search"
        params = group.params
        k = params.n
        eos = () if params.ignore_eos else group.eos_token_ids
        flat = [(beam.cumulative_logprob + lp, b, token)
                for b, (beam, cands) in enumerate(rows) for token, lp in cands]
        flat.sort(key=lambda x: -x[0])  # stable: ties keep beam order, then candidate order
        del flat[beam_candidates(group):]
        beams = [beam for beam, _ in rows]
        gen_len = beams[0].num_output_tokens + 1
        at_limit = gen_len >= params.max_tokens
        running: list[tuple[Sequence, int, float]] = []
        for rank, (score, b, token) in enumerate(flat):
            parent = beams[b]
            if token in eos or at_limit:
                if rank < k and state.improvable:
                    reason = FinishReason.STOP if token in eos else FinishReason.LENGTH
                    state.finished.append((score / gen_len**params.length_penalty, parent.output_ids + [token], reason))
            elif len(running) < k:
                running.append((parent, token, score))
        state.finished.sort(key=lambda h: -h[0])
        del state.finished[k:]
        if running and len(state.finished) == k:
            best = running[0][2] / gen_len**params.length_penalty
            state.improvable = best > state.finished[-1][0]
        if not running or not state.improvable:
            for b in beams:
                self.stops.finish(b, FinishReason.STOP)
            return 0
        self._apply(group, beams, running)
        return len(running)

    def _apply(self, group: SequenceGroup, beams: list[Sequence], running: list[tuple[Sequence, int, float]]) -> None:
        """Reuse each parent for its first child, fork it for the others, drop unused parents."""
        used: set[int] = set()
        targets = []
        for parent, token, score in running:
            child = self.forks.fork(group, parent) if parent.seq_id in used else parent
            used.add(parent.seq_id)
            targets.append((child, token, score))
        for b in beams:
            if b.seq_id not in used:
                self.forks.drop(group, b)
        for seq, token, score in targets:
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
