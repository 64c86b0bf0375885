"""The measured-profile path: `bench profile` writes a profile the simulator reads, a step model
fitted to it reproduces the steps it saw, and `sim validate` compares both drivers."""

import json
import math

import numpy as np
import pytest

from kvpool.bench.validate import sim_requests
from kvpool.costs.cost_model import FEATURES, WAKE_AFTER_S, MeasuredCostModel, step_features
from kvpool.costs.presets import get_hardware, get_model
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.instance import simulate_offline

LAW = (0.02, 0.001, 0.0005, 0.004, 2e-8, 1e-6, 0.01, 0.002, 1e-4, 0.03)  # seconds per FEATURES unit
DENSE_ABOVE = 16  # steps of more tokens pay the dense-weights term


def _law_seconds(new_tokens, context_lens, idle_s=0.0) -> float:
    return float(np.dot(LAW, step_features(new_tokens, context_lens, DENSE_ABOVE, idle_s)))


def _law_profile(n: int = 40, seed: int = 0) -> dict:
    """A profile document whose steps follow LAW exactly (no engine needed to make it)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        b = int(rng.integers(1, 33))
        chunks = int(rng.integers(0, min(b, 2) + 1))
        new = [int(rng.integers(2, 300)) for _ in range(chunks)] + [1] * (b - chunks)
        ctx = [x + int(rng.integers(0, 800)) for x in new]
        idle = float(rng.choice([0.0, 0.3]))
        samples.append({"num_seqs": b, "new_tokens": new, "context_lens": ctx, "idle_s": idle,
                        "seconds": _law_seconds(new, ctx, idle)})
    return {"model": "smollm2-135m", "hardware": "cpu", "block_size": 16, "engine": {"q4_rows": DENSE_ABOVE},
            "samples": samples}


def test_simulator_reproduces_a_known_linear_step_law():
    """A profile drawn from a known law: the fit recovers it, and the simulated makespan is the
    law summed over the steps the real scheduler produces."""
    samples = _law_profile()["samples"]  # decode-only steps and steps with 1-2 prefill chunks
    dense = FEATURES.index("dense_step")
    assert 5 < sum(step_features(s["new_tokens"], s["context_lens"], DENSE_ABOVE)[dense] for s in samples) < 35
    cost = MeasuredCostModel.from_samples(samples, get_model("smollm2-135m"), get_hardware("cpu"), 16,
                                          dense_above=DENSE_ABOVE)
    assert len(cost.fitted.coef) == len(FEATURES)
    assert cost.fitted.rel_rmse < 1e-6
    prompts = [list(range(n)) for n in (40, 97, 200, 33)]
    cfg = SchedulerConfig(num_blocks=200, block_size=16, max_num_batched_tokens=256, max_model_len=1024)
    shapes = []

    class Recording:
        def step_time(self, batch):
            shapes.append((list(batch.new_tokens), list(batch.context_lens), batch.idle_s))
            return cost.step_time(batch)

        def kv_transfer_time(self, n):
            return cost.kv_transfer_time(n)

    run = simulate_offline(sim_requests(prompts, 8, [0.0] * 4), cfg, Recording())
    assert math.isclose(run.end_s, sum(_law_seconds(n, c, i) for n, c, i in shapes), rel_tol=1e-6)
    assert [i > 0 for _, _, i in shapes] == [True] + [False] * (len(shapes) - 1)  # only the first step wakes
    assert all(m.output_len == 8 for m in run.metrics)


def test_validate_command_reports_engine_against_simulator(tmp_path, capsys):
    """The command end to end at a tiny size with a given profile: one engine run of each kind,
    a row per metric in the table and in validate.json."""
    from kvpool.cli import main

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_law_profile()))
    out = tmp_path / "out"
    assert main(["sim", "validate", "--profile", str(profile), "--num-requests", "3", "--output-len", "3",
                 "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads((out / "validate.json").read_text())
    assert [r["metric"] for r in res["rows"]] == ["offline output tokens/s", "poisson mean TTFT (s)",
                                                   "poisson mean TPOT (s)"]
    for r in res["rows"]:
        assert r["engine"] > 0 and r["sim"] > 0 and r["engine_min"] == r["engine"] == r["engine_max"]
        # the JSON rounds every value to 6 decimals: allow for it when sim and engine are close
        assert r["rel_error"] == pytest.approx((r["sim"] - r["engine"]) / r["engine"], rel=1e-4, abs=1e-4)
    assert res["profile_samples"] == 40 and res["fit_rel_rmse"] < 1e-6
    assert "rel_error" in capsys.readouterr().out


def test_validate_rejects_zero_repeats_with_a_message(capsys):
    from kvpool.cli import main

    assert main(["sim", "validate", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine():
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import Engine

    return Engine(EngineConfig(num_blocks=256, max_num_batched_tokens=512))


@pytest.mark.slow
def test_bench_profile_writes_a_profile_the_cost_model_reads(engine, tmp_path):
    from kvpool.bench.profile import run_profile

    doc = run_profile(engine.config, "tiny", engine=engine)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    cost = MeasuredCostModel.from_profile(path)
    samples = doc["samples"]
    assert all(len(s["new_tokens"]) == len(s["context_lens"]) == s["num_seqs"] and s["seconds"] > 0 for s in samples)
    assert any(s["num_seqs"] >= 4 and set(s["new_tokens"]) == {1} for s in samples)  # a decode batch
    assert any(s["num_seqs"] == 1 and s["context_lens"][0] > s["new_tokens"][0] > 1 for s in samples)  # cached prefix
    assert any(s["idle_s"] >= WAKE_AFTER_S for s in samples)  # prefills after a pause
    assert sum(s["idle_s"] >= WAKE_AFTER_S for s in samples) <= 3  # ... and only those (warm-up aside)
    assert cost.fitted.rel_rmse >= 0


@pytest.mark.slow
def test_fitted_model_predicts_the_engine_steps_it_was_fitted_on(engine):
    """Fit quality: the simulator, with a model fitted to the steps of an offline engine run,
    schedules the same steps and predicts their total time within 10%."""
    from kvpool.bench.profile import StepRecorder
    from kvpool.bench.throughput import make_workload
    from kvpool.sched.sampling_params import SamplingParams

    prompts = make_workload(8, 32, 256, engine.loaded.config.vocab_size, seed=3)
    rec = StepRecorder(engine)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    rec.drain()
    engine.scheduler.schedule = rec._schedule  # unwrap for the next test
    cost = MeasuredCostModel.from_samples(rec.samples, get_model("smollm2-135m"), get_hardware("cpu"), 16,
                                          dense_above=engine.runner.model.q4_rows)
    run = simulate_offline(sim_requests(prompts, 8, [0.0] * 8), engine.scheduler.config, cost)
    assert run.instance.counters.steps == len(rec.samples)
    measured = sum(s["seconds"] for s in rec.samples)
    assert abs(run.end_s - measured) / measured <= 0.10


@pytest.mark.slow
def test_validate_compares_engine_and_simulator(engine):
    from kvpool.bench.profile import run_profile
    from kvpool.bench.validate import ValidateSpec, validate

    profile = run_profile(engine.config, "tiny", engine=engine)
    res = validate(ValidateSpec(num_requests=6, output_len=8, repeats=2), engine, profile)
    assert [r["metric"] for r in res["rows"]] == ["offline output tokens/s", "poisson mean TTFT (s)",
                                                   "poisson mean TPOT (s)"]
    assert all(r["engine"] > 0 and r["sim"] > 0 and math.isfinite(r["rel_error"]) for r in res["rows"])
    assert all(r["engine_min"] <= r["engine"] <= r["engine_max"] for r in res["rows"])
    assert abs(res["rows"][0]["rel_error"]) < 0.5  # loose: the tiny profile and a shared CPU are noisy
