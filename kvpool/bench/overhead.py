"""`kvpool bench overhead`: how much of a decode step is not kernel work.

A batch of `--batch` requests is prefilled, then `--steps` plain decode steps are timed whole
(`engine.step()`: scheduling, metadata, forward, sampling). The same steps run once more under
torch.profiler, which records every op called from Python with its inclusive time; the step's
overhead is its wall time minus the time inside those top-level ops: Python (model code,
scheduler, sampler), argument parsing and dispatch up to the op's own record. The profiler adds
a little to every op, so the figure is an upper bound on what fusing ops can save.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.profiler_util import EventList

from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class Overhead:
    step_ms: float  # median wall time of a decode step, profiler off
    cpu_ms: float  # median CPU time of the engine thread per step (below step_ms: descheduled)
    op_ms: float  # per step, time inside top-level ops (profiler on)
    profiled_step_ms: float  # per step, wall time with the profiler on
    ops_per_step: float  # top-level op calls per step
    top_ops: list[tuple[str, int, float]]  # (op, calls per step, ms per step), by time

    @property
    def overhead_fraction(self) -> float:
        """Share of a profiled step spent outside top-level ops."""
        return max(0.0, 1.0 - self.op_ms / self.profiled_step_ms)


def _decode_ready(engine: Engine, batch: int, prompt_len: int, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=3 * steps + 8, min_tokens=3 * steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(0, engine.loaded.config.vocab_size, size=prompt_len).tolist(), params)
    while engine.scheduler.waiting or any(s.in_prefill for g in engine.scheduler.running for s in g.seqs):
        engine.step()
    engine.step()  # the first step with every row decoding


def _top_level(events: EventList) -> list:
    return [e for e in events if e.cpu_parent is None and not e.name.startswith("ProfilerStep")]


def measure(engine: Engine, batch: int = 8, prompt_len: int = 64, steps: int = 16, seed: int = 0) -> Overhead:
    _decode_ready(engine, batch, prompt_len, steps, seed)
    walls, cpus = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.thread_time()
        engine.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.thread_time() - c)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = time.perf_counter() - start
    top = _top_level(prof.events())
    calls: Counter[str] = Counter()
    spent: Counter[str] = Counter()
    for e in top:
        calls[e.name] += 1
        spent[e.name] += e.cpu_time_total
    op_us = sum(spent.values())
    ranked = [(name, round(calls[name] / steps), t / steps / 1e3) for name, t in spent.most_common(12)]
    return Overhead(
        step_ms=float(np.median(walls)) * 1e3, cpu_ms=float(np.median(cpus)) * 1e3,
        op_ms=op_us / steps / 1e3, profiled_step_ms=profiled / steps * 1e3,
        ops_per_step=len(top) / steps, top_ops=ranked,
    )


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, default=8, help="decode rows per step")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each decode row")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (and again profiled)")
    p.add_argument("--seed-workload", type=int, default=0)
    add_engine_args(p)


def main(args) -> int:
    engine = Engine(engine_config_from_args(args))
    r = measure(engine, args.batch, args.prompt_len, args.steps, args.seed_workload)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"decode step, batch {args.batch} ({engine.dtype}): {r.step_ms:.2f} ms wall, {r.cpu_ms:.2f} ms CPU "
          f"(load average {load})")
    print(f"profiled: {r.profiled_step_ms:.2f} ms a step, {r.op_ms:.2f} ms inside {r.ops_per_step:.0f} top-level ops: "
          f"overhead {r.overhead_fraction:.1%} of the step")
    for name, n, ms in r.top_ops:
        print(f"  {name:<40} {n:>5} calls {ms:>8.2f} ms")
    return 0
