"""The engine end to end on the bundled model: batching, preemption, sampling, beams, errors."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leak, make_engine, run_all
from test_model_reference import PROMPTS

from kvpool.engine.llm import step_until_done
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)  # as HF min_new_tokens


@pytest.fixture(scope="module")
def ample(loaded):
    engine = make_engine(loaded, num_blocks=1024, block_size=16)
    return [o.outputs[0].token_ids for o in run_all(engine, PROMPTS, GREEDY)]


def test_batched_greedy_equals_transformers_generate(loaded, hf_model, ample):
    for prompt, ours in zip(PROMPTS, ample, strict=True):
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert ours == ref[0, len(ids):].tolist(), prompt


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs_and_frees_every_block(loaded, ample, mode):
    engine = make_engine(loaded, num_blocks=16, block_size=4, preemption_mode=mode, swap_space="64MiB",
                         max_num_batched_tokens=64)
    outs = run_all(engine, PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions >= 10
    assert [o.outputs[0].token_ids for o in outs] == ample
    assert_no_leak(engine)
    if mode == "swap":
        assert engine.scheduler.num_swapped_blocks > 0


def test_seeded_parallel_samples_are_reproducible_with_n_minus_one_copies(loaded):
    params = SamplingParams(n=4, max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    results = []
    for _ in range(2):
        engine = make_engine(loaded, num_blocks=256, block_size=16)
        prompt = loaded.tokenizer.encode("Write a word:")  # a partial last block
        assert len(prompt) % 16
        (out,) = run_all(engine, [prompt], params)
        results.append([o.token_ids for o in out.outputs])
        assert engine.scheduler.kv.num_cow_copies == 3
        assert_no_leak(engine)
    assert results[0] == results[1]
    assert len({tuple(r) for r in results[0]}) > 1  # the samples differ from each other


def test_seeded_request_does_not_depend_on_its_batch(loaded):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone = run_all(make_engine(loaded, num_blocks=256), ["Tell me a story"], params)[0]
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    engine = make_engine(loaded, num_blocks=256)
    rid = engine.add_request("Tell me a story", params)
    engine.add_request("Something else entirely", other)
    done = step_until_done(engine)
    assert done[rid].outputs[0].token_ids == alone.outputs[0].token_ids


def test_beam_search_matches_transformers_best_sequence(loaded, hf_model):
    prompts = PROMPTS[:4]
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=12, temperature=0.0)
    engine = make_engine(loaded, num_blocks=512, block_size=16)
    outs = run_all(engine, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), num_beams=4, max_new_tokens=12, do_sample=False,
                                    early_stopping=False, length_penalty=1.0)
        best = out.outputs[0].token_ids
        ref_ids = ref[0, len(ids):].tolist()
        eos = set(loaded.tokenizer.eos_token_ids)
        assert best == ref_ids[: len(best)] and set(ref_ids[len(best):]) <= eos | {0}, prompt
    assert_no_leak(engine)


def test_stop_strings_min_tokens_and_logprobs(loaded):
    engine = make_engine(loaded, num_blocks=256)
    (out,) = run_all(engine, ["1, 2, 3, 4, 5, 6,"], SamplingParams(max_tokens=30, temperature=0.0, stop=[" 9"]))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 9"
    assert out.outputs[0].text.strip().endswith("8,") and " 9" not in out.outputs[0].text
    (out,) = run_all(engine, ["Hi"], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))
    o = out.outputs[0]
    assert len(o.logprobs) == len(o.token_ids) and all(len(t) == 3 for t in o.top_logprobs)
    assert all(lp <= 0 for lp in o.logprobs)
    assert o.top_logprobs[0][0][0] == o.token_ids[0]  # greedy picks the top token


def test_bad_requests_fail_clearly_and_engine_keeps_serving(loaded):
    engine = make_engine(loaded, num_blocks=256, max_model_len=128)
    good = engine.add_request("Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    with pytest.raises(InvalidRequest, match="context length of 128"):
        engine.add_request(list(range(200)), SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.add_request("Hello", SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("", SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequest, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokens": 5, "temprature": 0.5})
    with pytest.raises(InvalidRequest, match="prompt: token id -5 is outside the vocabulary"):
        engine.add_request([1, 2, -5], SamplingParams(max_tokens=5))
    done = step_until_done(engine)
    assert list(done) == [good] and len(done[good].outputs[0].token_ids) == 5
    assert_no_leak(engine)


def test_prefix_cache_hit_is_reported_and_output_unchanged(loaded):
    engine = make_engine(loaded, num_blocks=256, block_size=16)
    prompt = "A long shared system prompt. " * 8 + "Question:"
    first = run_all(engine, [prompt], GREEDY)[0]
    second = run_all(engine, [prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 48
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_published_kv_events_replay_to_what_the_cache_holds(loaded):
    """A conductor applies a drain's stored, then evicted hashes; a block evicted and
    registered again between two drains must still end up held in that replay."""
    engine = make_engine(loaded, num_blocks=12, block_size=4, publish_kv_events=True)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    a, b = list(range(100, 140)), list(range(200, 240))  # 10 blocks each: b must evict a
    index: set[bytes] = set()
    for prompts in ([a], [b], [a]):  # b evicts a's blocks, then a comes back: no drain between
        run_all(engine, prompts, params)
    events = engine.drain_kv_events()
    index.update(events.stored)
    index.difference_update(events.evicted)
    held = {blk.block_hash for blk in engine.scheduler.kv.pool.blocks if blk.block_hash is not None}
    assert held and index == held
    assert engine.drain_kv_events().stored == []
