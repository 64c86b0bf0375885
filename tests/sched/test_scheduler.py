"""The scheduler driven by a stand-in model whose next token is a pure function of the
whole context, so any scheduling mistake (lost KV, wrong order, double compute) changes
the outputs."""

from __future__ import annotations

import hashlib

import pytest

from kvpool.errors import InvalidRequest
from kvpool.sched.output import Sample, ScheduledSeq
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 1000


def next_token(context: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(str(context).encode(), digest_size=4).digest(), "little") % VOCAB


class Driver:
    """Plays the engine: checks each step computes exactly the missing tokens, in order."""

    def __init__(self, **cfg) -> None:
        self.s = Scheduler(SchedulerConfig(**cfg))
        self.kv_of: dict[int, list[int]] = {}  # seq_id -> tokens whose KV is "computed"
        self.steps = 0
        self.max_batched = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, n: int = 1, arrival: float = 0.0) -> SequenceGroup:
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True)
        g = SequenceGroup(rid, [self.s.new_sequence(prompt)], params, arrival)
        self.s.add_request(g)
        return g

    def run(self, max_steps: int = 10_000) -> dict[str, list[list[int]]]:
        results = {}
        while self.s.has_unfinished():
            self.steps += 1
            assert self.steps < max_steps, "scheduler made no progress"
            out = self.s.schedule()
            self.max_batched = max(self.max_batched, out.num_batched_tokens)
            assert out.num_batched_tokens <= self.s.config.max_num_batched_tokens
            for s in out.scheduled:
                assert s.start == s.seq.num_computed_tokens
            for g in self.s.postprocess(out, [draw(x) for x in out.sampling]):
                results[g.request_id] = sorted(x.output_ids for x in g.seqs)
        return results


def draw(s: ScheduledSeq) -> Sample:
    """The stand-in model's tokens for a sampling row: sample j of a request draws
    next_token(context) shifted by j, so samples differ but each is reproducible."""
    base = next_token(s.seq.token_ids)
    if s.group.params.n == 1:
        return Sample([base])
    first = s.seq.sample_index
    return Sample([(base + first + j) % VOCAB for j in range(s.num_samples)])


def ones(out) -> list[Sample]:
    return [Sample([1] * x.num_samples) for x in out.sampling]


def make_prompts(k: int, seed: int = 0) -> list[list[int]]:
    shared = [7] * 40
    return [(shared if i % 3 == 0 else []) + [(seed * 31 + i * 17 + j) % VOCAB for j in range(20 + (i * 37) % 90)]
            for i in range(k)]


def run_workload(num_blocks: int, mode: str = "recompute", n: int = 1, **cfg) -> tuple[dict, Driver]:
    d = Driver(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=256, preemption_mode=mode,
               num_host_blocks=512, **cfg)
    for i, p in enumerate(make_prompts(24)):
        wide = n > 1 and i % 4 == 0
        d.add(f"r{i}", p[:30] if wide else p, max_tokens=30 + i % 7, n=n if wide else 1, arrival=i)
    res = d.run()
    return res, d


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("n", [1, 3])
def test_outputs_under_memory_pressure_equal_ample_memory(mode, n):
    ample, _ = run_workload(4096, n=n)
    tight, d = run_workload(60, mode=mode, n=n)
    assert d.s.num_preemptions >= 10
    assert tight == ample
    assert d.s.kv.num_free_blocks == 60 and not d.s.kv.seqs
    assert all(b.ref_count == 0 for b in d.s.kv.pool.blocks)
    assert d.s.kv.host.num_free == 512


def test_swap_mode_actually_swaps():
    _, d = run_workload(70, mode="swap")
    assert d.s.num_swapped_blocks > 0


def test_chunked_prefill_respects_token_budget_and_finishes_long_prompt():
    d = Driver(num_blocks=256, block_size=16, max_num_batched_tokens=64)
    d.add("long", list(range(500)), max_tokens=3)
    d.add("short", list(range(10)), max_tokens=3)
    res = d.run()
    assert d.max_batched <= 64 and len(res["long"][0]) == 3


def test_oldest_request_always_progresses():
    d = Driver(num_blocks=30, block_size=4, max_num_batched_tokens=512)
    g0 = d.add("old", list(range(30)), max_tokens=60)
    for i in range(5):
        d.add(f"new{i}", list(range(100 + i, 130 + i)), max_tokens=60)
    while d.s.has_unfinished() and not g0.is_finished:
        before = g0.seqs[0].num_computed_tokens
        out = d.s.schedule()
        assert all(p is not g0 for p in out.preempted)
        d.s.postprocess(out, ones(out))
        assert g0.is_finished or g0.seqs[0].num_computed_tokens > before


def test_prefix_cache_hits_skip_prompt_tokens():
    d = Driver(num_blocks=256, block_size=16)
    prompt = list(range(100))
    d.add("a", prompt, max_tokens=2)
    d.run()
    g = d.add("b", prompt + [5, 6], max_tokens=2)
    out = d.s.schedule()
    assert g.num_cached_prompt_tokens == 96
    assert out.scheduled[0].num_new_tokens == 6


def test_requests_that_cannot_fit_the_cache_are_refused_clearly():
    """The core's part of validation (the input processor asks it): a group whose KV could
    never fit would wait forever. The context length and an empty prompt: tests/engine/test_input_processor.py."""
    d = Driver(num_blocks=8, block_size=16, max_model_len=256)
    with pytest.raises(InvalidRequest, match="cache has only 8"):
        d.s.check_capacity(100, SamplingParams(max_tokens=100))
    d.s.check_capacity(100, SamplingParams(max_tokens=20))  # 8 blocks of 16 hold 120 tokens
    with pytest.raises(InvalidRequest, match="cache has only 8"):
        d.s.check_capacity(100, SamplingParams(max_tokens=20, n=2))
    d.add("ok", list(range(10)), max_tokens=5)
    assert len(d.run()["ok"][0]) == 5


def test_abort_frees_blocks_immediately():
    d = Driver(num_blocks=64, block_size=4)
    d.add("a", list(range(40)), max_tokens=50)
    d.add("b", list(range(50, 90)), max_tokens=50)
    out = d.s.schedule()
    d.s.postprocess(out, ones(out))
    d.s.abort("a")
    assert "a" not in d.s.groups
    assert sum(len(t) for t in (d.s.kv.block_table(s.seq_id) for g in d.s.running for s in g.live_seqs)) == 10
    res = d.run()
    assert list(res) == ["b"]
    assert d.s.kv.num_free_blocks == 64


def test_preempted_parallel_group_larger_than_budget_still_finishes():
    """A recomputed n=4 group whose sequences together exceed the token budget is prefilled
    over several steps instead of stalling."""
    d = Driver(num_blocks=80, block_size=16, max_num_batched_tokens=256, max_model_len=2048)
    d.add("wide", list(range(200)), max_tokens=100, n=4)
    for i in range(3):
        d.add(f"other{i}", list(range(300 + i, 500 + i)), max_tokens=100)
    res = d.run()
    assert d.s.num_preemptions >= 1
    assert sorted(res) == ["other0", "other1", "other2", "wide"]
    assert all(len(x) == 100 for x in res["wide"])


def test_live_seqs_is_a_copy_callers_may_iterate_while_the_group_changes():
    d = Driver(num_blocks=64, block_size=4)
    g = d.add("a", list(range(10)), max_tokens=5)
    live = g.live_seqs
    d.s.kv.allocate(g.seqs[0].seq_id, g.seqs[0].token_ids)
    d.s.fork(g, g.seqs[0])
    assert len(live) == 1 and len(g.live_seqs) == 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_groups_take_blocks_chunk_by_chunk_and_outputs_equal_ample_memory(mode):
    """A window group gets blocks for the prefill chunk and the window behind it, not the whole
    prompt: prompts whose every block would not fit at once are served in a small pool, with
    preemption, and give the tokens an ample pool gives."""
    W, B, chunk = 8, 4, 8

    def workload(num_blocks: int) -> tuple[dict, Driver, int]:
        d = Driver(num_blocks=num_blocks, block_size=B, max_num_batched_tokens=chunk, preemption_mode=mode,
                   num_host_blocks=512, kv_group_windows=(None, W), max_model_len=256)
        for i, p in enumerate(make_prompts(8)):
            d.add(f"r{i}", p, max_tokens=10 + i, arrival=i)
        kv, most, results = d.s.kv, 0, {}
        for _ in range(20_000):
            if not d.s.has_unfinished():
                break
            out = d.s.schedule()
            for s in out.scheduled:
                assert s.start == s.seq.num_computed_tokens
                most = max(most, kv.blocks_held(s.seq.seq_id)[1])
            for g in d.s.postprocess(out, [draw(x) for x in out.sampling]):
                results[g.request_id] = [x.output_ids for x in g.seqs]
        assert not d.s.has_unfinished(), "the scheduler made no progress"
        assert not kv.seqs and kv.num_free_blocks == num_blocks
        return results, d, most

    ample, _, _ = workload(4096)
    tight, d, most = workload(48)
    assert most <= (W - 1 + chunk) // B + 2
    longest = max(len(p) for p in make_prompts(8))
    assert d.s.kv.max_blocks(longest, longest) > 48  # every block of its prompt at once would not fit
    assert d.s.num_preemptions >= 1
    assert tight == ample


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_window_request_whose_context_outgrew_the_first_chunks_blocks_finishes(mode):
    """Recomputing a preempted request prefills its prompt and every token it generated: the
    window groups' blocks for one full chunk of that can exceed the pool (the admission check
    saw only the short prompt). The chunk shrinks to what fits instead of waiting forever."""
    def workload(num_blocks: int) -> tuple[dict, Driver]:
        d = Driver(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, preemption_mode=mode,
                   num_host_blocks=64, kv_group_windows=(None, 3, 3), max_model_len=96)
        for i in range(2):
            d.add(f"r{i}", [0] * 8 + [100 + i], max_tokens=25, arrival=i)
        return d.run(max_steps=500), d

    ample, _ = workload(4096)
    tight, d = workload(24)
    assert d.s.num_preemptions >= 1
    assert tight == ample
    assert d.s.kv.num_free_blocks == 24 and not d.s.kv.seqs
