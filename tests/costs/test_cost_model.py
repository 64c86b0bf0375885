"""Roofline and measured step-time models."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.costs.cost_model import (
    MeasuredCostModel,
    RooflineCostModel,
    StepBatch,
    fit_step_model,
    step_features,
)
from kvpool.costs.presets import get_hardware, get_model
from kvpool.errors import ConfigError


@pytest.fixture
def roofline():
    return RooflineCostModel(get_model("llama2-13b"), get_hardware("a100-40gb"))


def test_roofline_step_time_is_monotone_in_tokens(roofline):
    times = [roofline.step_time(StepBatch([n], [n])) for n in (1, 16, 128, 512, 2048)]
    assert times == sorted(times) and times[0] < times[-1]


def test_roofline_step_time_is_monotone_in_context(roofline):
    times = [roofline.step_time(StepBatch([1] * 32, [c] * 32)) for c in (16, 256, 1024, 4096)]
    assert times == sorted(times) and times[0] < times[-1]


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound(roofline):
    m, hw = get_model("llama2-13b"), get_hardware("a100-40gb")
    decode = roofline.step_time(StepBatch([1], [10])) - roofline.overhead_s
    assert decode == pytest.approx(m.weight_bytes() / (0.7 * hw.mem_bandwidth), rel=0.01)
    prefill = roofline.step_time(StepBatch([2048], [2048])) - roofline.overhead_s
    assert prefill > 2 * m.params * 2048 / (0.5 * hw.peak_flops)


def test_block_movements_add_time(roofline):
    base = roofline.step_time(StepBatch([1], [100]))
    for kw in ("blocks_swapped_in", "blocks_copied", "blocks_from_host", "blocks_from_disk",
               "blocks_from_remote"):
        assert roofline.step_time(StepBatch([1], [100], **{kw: 10})) > base
    assert roofline.kv_transfer_time(200) > roofline.kv_transfer_time(100) > 0
    assert roofline.kv_transfer_time(0) == 0


def test_step_batch_rejects_mismatched_lists():
    with pytest.raises(ConfigError, match="context_lens"):
        StepBatch([1, 1], [5])


def _synthetic_samples(law, n=60, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        k = int(rng.integers(1, 9))
        if rng.random() < 0.5:  # decode step
            new = [1] * k
            ctx = rng.integers(10, 2000, k).tolist()
        else:  # prefill chunks
            new = rng.integers(16, 512, k).tolist()
            ctx = [c + int(rng.integers(0, 200)) for c in new]
        secs = float(np.dot(law, step_features(new, ctx)))
        samples.append({"num_seqs": k, "new_tokens": new, "context_lens": ctx, "seconds": secs})
    return samples


def test_fit_recovers_known_linear_law_within_one_percent(tmp_path):
    law = [0.02, 0.001, 5e-5, 0.004, 2e-9, 1e-6, 0.0, 0.0, 0.0, 0.0]  # no 4-bit kernels, samples never idle
    samples = _synthetic_samples(law)
    fitted = fit_step_model(samples)
    assert fitted.coef == pytest.approx(law, rel=0.01)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "hardware": "cpu", "block_size": 16,
                                "samples": samples}))
    measured = MeasuredCostModel.from_profile(path)
    for s in _synthetic_samples(law, n=20, seed=1):
        predicted = measured.step_time(StepBatch(s["new_tokens"], s["context_lens"]))
        assert predicted == pytest.approx(s["seconds"], rel=0.01)


def test_fit_never_returns_negative_coefficients():
    law = [0.01, 0.0, 1e-4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    samples = _synthetic_samples(law)
    rng = np.random.default_rng(3)
    for s in samples:
        s["seconds"] *= 1 + 0.05 * rng.standard_normal()
    fitted = fit_step_model(samples)
    assert all(c >= 0 for c in fitted.coef)
    assert fitted.rel_rmse < 0.1


def test_fit_predicts_the_mean_step_under_slowdown_noise():
    """On a shared machine noise only slows steps down (a neighbour takes the core, a stall).
    The fit must predict the mean step time the simulator adds up, not the fast mode."""
    law = [0.02, 0.001, 5e-5, 0.004, 2e-9, 1e-6, 0.0, 0.0, 0.0, 0.0]
    samples = _synthetic_samples(law, n=400, seed=4)
    rng = np.random.default_rng(5)
    for s in samples:
        s["seconds"] *= 1 + rng.exponential(0.15)  # mean slowdown 15%, heavy right tail
    fitted = fit_step_model(samples)
    predicted = sum(fitted.predict(s["new_tokens"], s["context_lens"]) for s in samples)
    assert predicted / sum(s["seconds"] for s in samples) == pytest.approx(1.0, abs=0.01)  # 1/measured weights: 0.97-0.98


def test_profile_missing_keys_is_a_config_error(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "samples": []}))
    with pytest.raises(ConfigError, match="block_size"):
        MeasuredCostModel.from_profile(path)


def _roofline_by_the_formula(model: RooflineCostModel, new_tokens: list[int], context_lens: list[int]) -> float:
    """The roofline written out term by term from the presets (no hoisted constants)."""
    m, tpar = model.model, model.tp
    tokens = sum(new_tokens)
    flops = 2.0 * m.params * tokens
    flops += sum(m.attention_flops(n, c) for n, c in zip(new_tokens, context_lens, strict=True))
    nbytes = tpar.weight_bytes_per_gpu() + tpar.kv_bytes_per_token_per_gpu() * (sum(context_lens) + tokens)
    t = max(flops / tpar.tp / (model.mfu * model.hardware.peak_flops),
            nbytes / (model.mbu * model.hardware.mem_bandwidth))
    return t + tpar.allreduce_seconds(tokens) + model.overhead_s


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 100_000)), min_size=1, max_size=40),
       st.sampled_from([("llama2-70b", "a800-80gb", 8), ("opt-13b", "a100-40gb", 1)]))
def test_roofline_step_time_is_bit_identical_to_the_formula(seqs, setup):
    name, hw, tp = setup
    model = RooflineCostModel(get_model(name), get_hardware(hw), tp=tp)
    new = [n for n, _ in seqs]
    ctx = [n + c for n, c in seqs]
    assert model.step_time(StepBatch(new, ctx)) == _roofline_by_the_formula(model, new, ctx)
    ones = [1] * len(ctx)
    assert model.plain_decode_time(ctx) == model.step_time(StepBatch(ones, ctx)) == _roofline_by_the_formula(model, ones, ctx)


@settings(max_examples=100)
@given(st.lists(st.integers(1, 100_000), min_size=1, max_size=40), st.integers(0, 60), st.integers(0, 1),
       st.floats(0.0, 2.0), st.sampled_from([("llama2-70b", "a800-80gb", 8), ("opt-13b", "a100-40gb", 1)]))
def test_a_plain_decode_run_costs_each_step_as_step_time_does(ctx, most, least, horizon, setup):
    """The simulator's decode runs take their step times in one call: the same floats as
    `step_time` per step (contexts one longer each step), summed into end times in order, cut
    at the first step starting at or after `until` unless within the first `least`."""
    name, hw, tp = setup
    model = RooflineCostModel(get_model(name), get_hardware(hw), tp=tp)
    start = 5.0
    durations, ends = model.plain_decode_steps(len(ctx), sum(ctx), start, start + horizon, most, least)
    want_d, want_e, t = [], [], start
    for i in range(most):
        if i >= least and t >= start + horizon:
            break
        d = model.step_time(StepBatch([1] * len(ctx), [c + i for c in ctx]))
        t += d
        want_d.append(d)
        want_e.append(t)
    assert durations == want_d and ends == want_e
    assert len(ends) >= min(least, most)
