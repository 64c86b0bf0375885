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
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sim.cost_model import MeasuredCostModel
from kvpool.sim.instance import simulate_offline, simulate_poisson
from kvpool.sim.metrics import format_table, summarize, write_json
from kvpool.sim.workloads import OUTPUT_CHUNK_BASE, SYNTHETIC_CHUNK_BASE, SimRequest, arrival_times

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ValidateSpec:
    num_requests: int = 48
    input_len_min: int = 32
    input_len_max: int = 256
    output_len: int = 32
    rate: float | None = None  # req/s of the Poisson run; None = half the measured offline rate
    seed: int = 0


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
        out_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
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


def _row(metric: str, engine_value: float, sim_value: float) -> dict:
    return {"metric": metric, "engine": engine_value, "sim": sim_value,
            "rel_error": (sim_value - engine_value) / engine_value}


def validate(profile: dict, spec: ValidateSpec, engine: Engine) -> dict:
    """Run both comparisons on `engine` with a cost model fitted to `profile`."""
    cost = MeasuredCostModel.from_document(profile)
    cfg = engine.scheduler.config
    prompts = make_workload(spec.num_requests, spec.input_len_min, spec.input_len_max,
                            engine.loaded.config.vocab_size, spec.seed)
    elapsed, out_tokens = engine_offline(engine, prompts, spec.output_len)
    sim = simulate_offline(sim_requests(prompts, spec.output_len, [0.0] * len(prompts)), cfg, cost)
    rows = [_row("offline output tokens/s", out_tokens / elapsed, len(prompts) * spec.output_len / sim.end_s)]
    rate = spec.rate or 0.5 * len(prompts) / elapsed
    rng = np.random.default_rng(spec.seed + 1)
    arrivals = arrival_times(rng, len(prompts), rate).tolist()
    prompts2 = make_workload(spec.num_requests, spec.input_len_min, spec.input_len_max,
                             engine.loaded.config.vocab_size, spec.seed + 1)
    real = engine_poisson(engine, prompts2, spec.output_len, arrivals)
    s = summarize(simulate_poisson(sim_requests(prompts2, spec.output_len, arrivals), cfg, cost).metrics)
    rows.append(_row("poisson mean TTFT (s)", real["ttft_s"], s["ttft_s"]["mean"]))
    rows.append(_row("poisson mean TPOT (s)", real["tpot_s"], s["tpot_s"]["mean"]))
    return {"rows": rows, "rate_rps": rate, "spec": asdict(spec), "fit_rel_rmse": cost.fitted.rel_rmse,
            "profile_samples": len(profile["samples"])}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, default=None,
                   help="a `kvpool bench profile` JSON (default: run the quick profile first)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, default=None, help="Poisson req/s (default: half the offline rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("sim-out"))


def main(args: argparse.Namespace) -> int:
    engine = Engine(EngineConfig())
    if args.profile is not None:
        profile = json.loads(args.profile.read_text())
    else:
        profile = run_profile(engine.config, "quick", args.seed, engine=engine)
    spec = ValidateSpec(num_requests=args.num_requests, output_len=args.output_len, rate=args.rate, seed=args.seed)
    res = validate(profile, spec, engine)
    print(format_table(res["rows"]))
    print(f"Poisson rate {res['rate_rps']:.3f} req/s; step-model fit error {res['fit_rel_rmse']:.1%} "
          f"on {res['profile_samples']} profiled steps")
    path = write_json(args.out / "validate.json", res)
    print(f"wrote {path}")
    return 0
