"""The core's beam search, driven with exact candidate scores: it keeps the k best
continuations over all beams, shares the parents' blocks with their children, prunes the
parents nobody continues, and returns the k best finished hypotheses."""

from __future__ import annotations

import itertools
import math

from kvpool.sched.beam import beam_candidates
from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 7


def logprob(context: tuple[int, ...], token: int) -> float:
    """A fixed toy model: a deterministic distribution over VOCAB tokens per context."""
    weights = [1 + (hash((context, t)) % 97) for t in range(VOCAB)]
    return math.log(weights[token] / sum(weights))


def brute_force(prompt: tuple[int, ...], k: int, length: int) -> list[tuple[float, list[int]]]:
    """Beam search as defined (no EOS): keep the k best prefixes by summed logprob each step."""
    beams = [(0.0, [])]
    for _ in range(length):
        grown = [(s + logprob(prompt + tuple(out), t), out + [t]) for s, out in beams for t in range(VOCAB)]
        grown.sort(key=lambda x: -x[0])
        beams = grown[:k]
    return [(s / length, out) for s, out in beams]


def test_beam_search_in_the_core_equals_brute_force_and_frees_every_block():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=2, max_model_len=64))
    prompt = (3, 1, 4)
    k, length = 3, 5
    params = SamplingParams(n=k, use_beam_search=True, max_tokens=length, ignore_eos=True, temperature=0.0)
    group = SequenceGroup("b", [sched.new_sequence(prompt)], params, 0.0)
    sched.add_request(group)
    shared = 0
    for _ in itertools.count():
        out = sched.schedule()
        if out.is_empty:
            break
        sampled = []
        for s in out.sampling:
            ctx = tuple(s.seq.token_ids)
            cands = sorted(((t, logprob(ctx, t)) for t in range(VOCAB)), key=lambda c: -c[1])
            sampled.append(Sample(candidates=cands[: beam_candidates(s.group)]))
        sched.postprocess(out, sampled)
        pool = sched.kv.pool
        shared = max(shared, sum(1 for b in pool.blocks if b.ref_count > 1))
    got = [(score, ids) for score, ids, _ in group.beam.finished]
    want = brute_force(prompt, k, length)
    assert [ids for _, ids in got] == [ids for _, ids in want]
    assert all(math.isclose(a, b) for (a, _), (b, _) in zip(got, want, strict=True))
    assert shared > 0  # beams shared blocks along the way
    assert sched.kv.num_free_blocks == 64 and not sched.groups
