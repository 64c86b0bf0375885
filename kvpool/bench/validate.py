"""`kvpool sim validate`: the simulator against the real engine on this machine.

Both drivers run the same scheduler with the same config on the same requests; the simulator
pays step times from a `MeasuredCostModel` fitted to a `kvpool bench profile` of this engine.
(a) offline throughput (every request at t=0, the `bench throughput` workload at a smaller
size); (b) a Poisson run with wall-clock arrivals in the engine and the same arrival instants
in the simulator: mean TTFT and mean TPOT. Errors are (sim - engine) / engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvpool.bench.profile import run_profile
from kvpool.bench.throughput import make_workload
from kvpool.costs.cost_model import MeasuredCostModel
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.errors import ConfigError
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sim.instance import simulate_offline, simulate_poisson
from kvpool.sim.metrics import format_table, summarize, write_json
from kvpool.sim.workloads import OUTPUT_CHUNK_BASE, SYNTHETIC_CHUNK_BASE, SimRequest, arrival_times

logger = logging.getLogger(__name__)

# The default Poisson rate as a share of the measured offline request rate: a busy server
# (batches of several requests) short of the knee. At 0.5 the simulator itself shows a 10%
# slower step raising mean TPOT by 30% (batches grow as requests queue), so machine drift
# between profile and run would dominate the comparison; at 0.35 it raises TPOT by 16%.
SERVING_LOAD = 0.35


@dataclass(slots=True, frozen=True)
class ValidateSpec:
    num_requests: int = 48
    input_len_min: int = 32
    input_len_max: int = 256
    output_len: int = 32
    rate: float | None = None  # req/s of the Poisson run; None = SERVING_LOAD x the offline rate
    seed: int = 0
    repeats: int = 5  # engine runs per metric, each after its own quick profile when none is given


def sim_requests(prompts: list[list[int]], output_len: int, arrivals: list[float]) -> list[SimRequest]:
    """The engine's prompts as simulator requests: each its own chunk, so nothing is shared."""
    return [SimRequest(f"v{i}", arrivals[i], len(p), output_len, ((SYNTHETIC_CHUNK_BASE + 1 + i, len(p)),),
                       OUTPUT_CHUNK_BASE + i) for i, p in enumerate(prompts)]


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)


def engine_offline(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds, output tokens) for the whole batch queued at once."""
    for p in prompts:
        engine.add_request(p, _params(output_len))
    out_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        out_tokens += sum(len(c.token_ids) for o in engine.step() for c in o.outputs)  # each step's new tokens
    return time.perf_counter() - start, out_tokens


def engine_poisson(engine: Engine, prompts: list[list[int]], output_len: int, arrivals: list[float]) -> dict:
    """Requests join between steps once the wall clock passes their arrival; per-request
    TTFT and TPOT from the engine's own timestamps."""
    t0 = time.monotonic()
    ttft, tpot = [], []
    i = 0
    while i < len(prompts) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(prompts) and arrivals[i] <= now:
            engine.add_request(prompts[i], _params(output_len), request_id=f"p{i}", arrival_time=t0 + arrivals[i])
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(arrivals[i] - now, 0.0))
            continue
        for o in engine.step():
            if o.finished:
                m = o.metrics
                ttft.append(m.first_token_time - m.arrival_time)
                tpot.append((m.last_token_time - m.first_token_time) / max(len(m.token_times) - 1, 1))
    return {"ttft_s": float(np.mean(ttft)), "tpot_s": float(np.mean(tpot))}


def _row(metric: str, engine_runs: list[float], sim_value: float) -> dict:
    engine_value = float(np.mean(engine_runs))
    return {"metric": metric, "engine": engine_value, "engine_min": min(engine_runs),
            "engine_max": max(engine_runs), "sim": sim_value,
            "rel_error": (sim_value - engine_value) / engine_value}


def validate(spec: ValidateSpec, engine: Engine, profile: dict | None = None) -> dict:
    """Run both comparisons `spec.repeats` times on `engine` and compare their means with the
    simulator. Without a `profile`, a quick profile precedes every repeat and the cost model
    is fitted to all of them: this machine's speed drifts by 10-20% over minutes, so profile
    and runs interleave to see the same machine."""
    cfg = engine.scheduler.config
    vocab = engine.loaded.config.vocab_size
    prompts = make_workload(spec.num_requests, spec.input_len_min, spec.input_len_max, vocab, spec.seed)
    prompts2 = make_workload(spec.num_requests, spec.input_len_min, spec.input_len_max, vocab, spec.seed + 1)
    doc, samples = profile, list(profile["samples"]) if profile else []
    offline, ttft, tpot = [], [], []
    arrivals: list[float] = []
    for r in range(spec.repeats):
        if profile is None:
            engine.scheduler.kv.reset_prefix_cache()
            doc = run_profile(engine.config, "quick", spec.seed + r, engine=engine)
            samples += doc["samples"]
        engine.scheduler.kv.reset_prefix_cache()
        elapsed, out_tokens = engine_offline(engine, prompts, spec.output_len)
        offline.append(out_tokens / elapsed)
        if not arrivals:
            rate = spec.rate or SERVING_LOAD * len(prompts) / elapsed
            arrivals = arrival_times(np.random.default_rng(spec.seed + 1), len(prompts2), rate).tolist()
        engine.scheduler.kv.reset_prefix_cache()
        real = engine_poisson(engine, prompts2, spec.output_len, arrivals)
        ttft.append(real["ttft_s"])
        tpot.append(real["tpot_s"])
        logger.info("repeat %d/%d: offline %.1f tok/s, TTFT %.3f s, TPOT %.4f s",
                    r + 1, spec.repeats, offline[-1], ttft[-1], tpot[-1])
    cost = MeasuredCostModel.from_document({**doc, "samples": samples})
    sim = simulate_offline(sim_requests(prompts, spec.output_len, [0.0] * len(prompts)), cfg, cost)
    s = summarize(simulate_poisson(sim_requests(prompts2, spec.output_len, arrivals), cfg, cost).metrics)
    rows = [_row("offline output tokens/s", offline, len(prompts) * spec.output_len / sim.end_s),
            _row("poisson mean TTFT (s)", ttft, s["ttft_s"]["mean"]),
            _row("poisson mean TPOT (s)", tpot, s["tpot_s"]["mean"])]
    return {"rows": rows, "rate_rps": rate, "spec": asdict(spec), "fit_rel_rmse": cost.fitted.rel_rmse,
            "profile_samples": len(samples)}


_DEFAULTS = ValidateSpec()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, default=None,
                   help="a `kvpool bench profile` JSON (default: a quick profile before each repeat)")
    p.add_argument("--num-requests", type=int, default=_DEFAULTS.num_requests)
    p.add_argument("--output-len", type=int, default=_DEFAULTS.output_len)
    p.add_argument("--rate", type=float, default=None, help=f"Poisson req/s (default: {SERVING_LOAD} x the offline rate)")
    p.add_argument("--repeats", type=int, default=_DEFAULTS.repeats, help="engine runs averaged per metric")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--out", type=Path, default=Path("sim-out"))


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    engine = Engine(EngineConfig())
    profile = json.loads(args.profile.read_text()) if args.profile is not None else None
    spec = ValidateSpec(num_requests=args.num_requests, output_len=args.output_len, rate=args.rate,
                        seed=args.seed, repeats=args.repeats)
    res = validate(spec, engine, profile)
    print(format_table(res["rows"]))
    print(f"Poisson rate {res['rate_rps']:.3f} req/s; step-model fit error {res['fit_rel_rmse']:.1%} "
          f"on {res['profile_samples']} profiled steps; engine columns: mean, min and max of "
          f"{spec.repeats} runs")
    path = write_json(args.out / "validate.json", res)
    print(f"wrote {path}")
    return 0
