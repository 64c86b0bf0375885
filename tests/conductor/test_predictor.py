"""Predictors: monotone costs, transfer formula, and faithful adapters of the sim's models."""

import pytest

from kvpool.conductor.predictor import (
    CostModelPredictor,
    FittedPredictor,
    LinearPredictor,
    TransferCost,
)
from kvpool.costs.cost_model import RooflineCostModel, StepBatch, fit_step_model
from kvpool.costs.presets import get_hardware, get_model
from kvpool.errors import ConfigError


def test_linear_prefill_costs_less_with_more_cached_context_skipped():
    p = LinearPredictor(prefill_s_per_token=1e-3, prefill_attn_s_per_token_pair=1e-7)
    assert p.prefill_time(100, 900) < p.prefill_time(1000, 0)
    assert p.prefill_time(100, 900) > p.prefill_time(100, 0)  # attention sees the cache
    assert p.prefill_time(0, 500) == 0.0


def test_linear_decode_step_grows_with_batch_and_context():
    p = LinearPredictor(decode_step_s=0.01, decode_s_per_seq=1e-3, decode_s_per_context_token=1e-6)
    assert p.decode_step_time(2, 1000) == pytest.approx(0.01 + 2e-3 + 1e-3)
    assert p.decode_step_time(4, 1000) > p.decode_step_time(2, 1000)
    assert p.decode_step_time(0, 0) == 0.0


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    t = TransferCost(bandwidth_bytes_per_s=1e9, latency_s=0.002, block_bytes=10**6)
    assert t.time(0) == 0.0
    assert t.time(5) == pytest.approx(0.002 + 5e-3)


@pytest.mark.parametrize(
    "kwargs",
    [{"bandwidth_bytes_per_s": 0}, {"latency_s": -1.0}, {"block_bytes": -1}],
)
def test_transfer_cost_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        TransferCost(**kwargs)


def test_linear_predictor_rejects_negative_costs():
    with pytest.raises(ConfigError, match="prefill_s_per_token"):
        LinearPredictor(prefill_s_per_token=-1.0)


def test_fitted_predictor_asks_the_model_with_context_after_the_step():
    samples = [
        {"num_seqs": 1, "new_tokens": [n], "context_lens": [c + n], "seconds": 0.001 + 1e-5 * n}
        for n, c in [(10, 0), (100, 0), (500, 100), (1000, 0)]
    ] + [
        {"num_seqs": b, "new_tokens": [1] * b, "context_lens": [200] * b, "seconds": 0.01 + 1e-3 * b}
        for b in (1, 4, 16)
    ]
    model = fit_step_model(samples)
    p = FittedPredictor(model)
    assert p.prefill_time(300, 200) == pytest.approx(model.predict([300], [500]))
    assert p.decode_step_time(4, 802) == pytest.approx(model.predict([1] * 4, [201, 201, 200, 200]))


def test_cost_model_predictor_pays_what_the_simulator_pays():
    cost = RooflineCostModel(get_model("llama2-7b"), get_hardware("a100-80gb"))
    p = CostModelPredictor(cost)
    assert p.prefill_time(512, 1024) == cost.step_time(StepBatch([512], [1536]))
    assert p.decode_step_time(3, 3000) == cost.step_time(StepBatch([1, 1, 1], [1000] * 3))
    assert p.transfer_time(7) == cost.kv_transfer_time(7)
