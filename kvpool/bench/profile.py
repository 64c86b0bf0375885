"""`kvpool bench profile`: measure the real engine's step times on this machine and write the
profile `MeasuredCostModel.from_profile` fits (see kvpool/costs/cost_model.py for the schema).

Workloads are shaped so the scheduler produces the steps we want to cover — prefill chunks
with and without a cached prefix, decode batches of 1..64 distinct sequences at several context
lengths (those that fit in the KV cache), mixed decode + prefill steps, a staggered serving run
and prefills after a pause — and every `engine.step()` is timed whole (scheduling, block moves,
forward, sampling), together with the shape the scheduler gave it and the idle time before it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvpool.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from kvpool.engine.engine import Engine
from kvpool.engine.outputs import RequestOutput
from kvpool.errors import ConfigError
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ProfilePlan:
    """What to measure; decode contexts and cached prefixes are rounded down to whole blocks."""

    prefill_chunks: tuple[int, ...]
    cached_prefixes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int], ...]  # (decode batch, prefill chunk)
    decode_steps: int = 2
    serving: int = 0  # requests of a staggered serving run (distinct prompts, see _serving)
    wake: int = 0  # prefills measured right after a pause (see _after_pause)


PLANS = {
    "default": ProfilePlan((32, 128, 256, 512, 1024), (0, 512), (1, 4, 16, 32, 64), (128, 512, 1024),
                           ((8, 128), (8, 512), (32, 256)), serving=24, wake=12),
    "quick": ProfilePlan((32, 256), (0, 256), (1, 8, 48), (128, 256), ((8, 256),), decode_steps=4, serving=12,
                         wake=8),
    "tiny": ProfilePlan((16, 128), (0, 64), (1, 4), (64,), ((4, 64),), decode_steps=1, wake=2),
}


class StepRecorder:
    """Drives an engine step by step, timing each step and keeping its scheduled shape.

    It wraps the scheduler's `schedule` to see the plan the step executes; the engine itself
    is unchanged. Each sample also says how long the engine sat idle before it (`idle_s`).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.samples: list[dict] = []
        self._last: SchedulerOutput | None = None
        self._last_end = time.perf_counter()
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._capture  # type: ignore[method-assign]

    def _capture(self, now: float | None = None) -> SchedulerOutput:
        self._last = self._schedule(now)
        return self._last

    def step(self) -> list[RequestOutput]:
        self._last = None
        start = time.perf_counter()
        outs = self.engine.step()
        end = time.perf_counter()
        out = self._last
        if out is not None and not out.is_empty:
            self.samples.append({
                "num_seqs": len(out.scheduled),
                "new_tokens": [s.num_new_tokens for s in out.scheduled],
                "context_lens": [s.start + s.num_new_tokens for s in out.scheduled],
                "seconds": end - start,
                "idle_s": start - self._last_end,
            })
            self._last_end = end
        return outs

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.step()


class _Prompts:
    """Random token ids, fresh each call, so only prefixes we share on purpose are cached."""

    def __init__(self, vocab: int, block_size: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab, self.block_size = vocab, block_size

    def fresh(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, size=max(n, 1)).tolist()

    def blocks(self, n: int) -> list[int]:
        """A fresh prompt of `n` tokens rounded down to whole blocks (at least one block)."""
        return self.fresh(max(n // self.block_size, 1) * self.block_size)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _prefill(rec: StepRecorder, prompts: _Prompts, chunk: int, cached: int) -> None:
    prefix = prompts.blocks(cached) if cached else []
    if prefix:
        rec.engine.add_request(prefix, _params(1))
        rec.drain()
    rec.engine.add_request(prefix + prompts.fresh(chunk), _params(1))
    rec.drain()


def _start_decodes(rec: StepRecorder, prompts: _Prompts, batch: int, context: int, steps: int) -> None:
    """`batch` requests with distinct prompts of `context` tokens, run until every one is
    decoding; `steps` decode steps of the whole batch remain. Prompts are distinct because a
    shared cached prefix makes decode look cheap: a batch reading the same KV blocks hits the
    CPU cache (measured: decode of 32-48 rows at 256 tokens 8-20% faster than distinct rows).
    The prefills span several steps, so each request gets enough tokens to outlast them; the
    mixed steps on the way are recorded too."""
    budget = rec.engine.scheduler.config.max_num_batched_tokens
    prefill_steps = -(-batch * context // budget) + 1
    for _ in range(batch):
        rec.engine.add_request(prompts.fresh(context), _params(steps + prefill_steps))
    while rec.engine.has_unfinished():
        rec.step()
        if rec.samples and set(rec.samples[-1]["new_tokens"]) == {1}:
            return


def _fits(batch: int, context: int, engine: Engine) -> bool:
    """Whether `batch` distinct sequences of `context` tokens (and their decodes) fit in KV;
    a plan's larger shapes are skipped on a smaller cache rather than measured preempting."""
    cfg = engine.scheduler.config
    return batch * (context // cfg.block_size + 2) <= cfg.num_blocks


def _serving(rec: StepRecorder, prompts: _Prompts, requests: int, every: int = 4) -> None:
    """Distinct prompts (32-256 tokens, 32 output tokens) joining one every `every` steps: the
    steps of a serving run, batches growing and shrinking with mixed contexts."""
    lengths = prompts.rng.integers(32, 257, size=requests).tolist()
    for n in lengths:
        rec.engine.add_request(prompts.fresh(n), _params(32))
        for _ in range(every):
            rec.step()
    rec.drain()


PAUSE_S = 0.3  # idle time before a wake-up sample (well over cost_model.WAKE_AFTER_S)


def _after_pause(rec: StepRecorder, prompts: _Prompts, chunks: tuple[int, ...], count: int) -> None:
    """Prefills that start after the engine sat idle for PAUSE_S: what a request arriving at an
    idle server pays (the cost model's `wake` feature)."""
    for i in range(count):
        time.sleep(PAUSE_S)
        rec.engine.add_request(prompts.fresh(chunks[i % len(chunks)]), _params(1))
        rec.drain()


def profile_engine(engine: Engine, plan: ProfilePlan, seed: int = 0, progress: bool = True) -> list[dict]:
    """Run `plan` on `engine` (which must have prefix caching on) and return the step samples."""
    if not engine.scheduler.config.enable_prefix_caching:
        raise ConfigError("bench profile needs prefix caching on: cached prefixes keep the setup short")
    budget = engine.scheduler.config.max_num_batched_tokens
    if max(plan.prefill_chunks) > budget:
        raise ConfigError(f"prefill chunk {max(plan.prefill_chunks)} exceeds max_num_batched_tokens={budget}")
    prompts = _Prompts(engine.loaded.config.vocab_size, engine.scheduler.config.block_size, seed)
    rec = StepRecorder(engine)
    engine.add_request(prompts.fresh(16), _params(2))  # warm-up, not recorded
    while engine.has_unfinished():
        engine.step()
    jobs = [("prefill", c, p) for c in plan.prefill_chunks for p in plan.cached_prefixes]
    jobs += [("decode", b, c) for b in plan.decode_batches for c in plan.decode_contexts if _fits(b, c, engine)]
    jobs += [("mixed", b, c) for b, c in plan.mixed]
    jobs += [("serving", plan.serving, 0)] if plan.serving else []
    jobs += [("wake", plan.wake, 0)] if plan.wake else []
    for kind, a, b in tqdm(jobs, desc="profile", unit="shape", disable=not progress):
        if kind == "prefill":
            _prefill(rec, prompts, a, b)
        elif kind == "decode":
            _start_decodes(rec, prompts, a, b, plan.decode_steps)
            rec.drain()
        elif kind == "serving":
            _serving(rec, prompts, a)
        elif kind == "wake":
            _after_pause(rec, prompts, plan.prefill_chunks, a)
        else:
            _start_decodes(rec, prompts, a, 256, plan.decode_steps)
            engine.add_request(prompts.fresh(b), _params(1))
            rec.drain()
    return rec.samples


def profile_document(engine: Engine, samples: list[dict], wall_s: float) -> dict:
    cfg = engine.scheduler.config
    return {
        "model": "smollm2-135m" if engine.config.model is None else engine.loaded.name,
        "hardware": "cpu" if engine.device.type == "cpu" else engine.device.type,
        "block_size": cfg.block_size,
        "engine": {"name": engine.loaded.name, "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "num_blocks": cfg.num_blocks,
                   "q4_rows": engine.runner.model.q4_rows},
        "wall_s": wall_s,
        "samples": samples,
    }


def run_profile(config: EngineConfig, plan: str = "default", seed: int = 0,
                engine: Engine | None = None) -> dict:
    """Measure `plan` on a new engine (or the given one) and return the profile document."""
    if plan not in PLANS:
        raise ConfigError(f"unknown profile plan {plan!r}; choose one of {sorted(PLANS)}")
    engine = engine or Engine(config)
    start = time.perf_counter()
    samples = profile_engine(engine, PLANS[plan], seed)
    return profile_document(engine, samples, time.perf_counter() - start)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer shapes (under a minute)")
    p.add_argument("--out", type=Path, default=Path("profile.json"))
    p.add_argument("--seed-workload", type=int, default=0)
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    doc = run_profile(engine_config_from_args(args), "quick" if args.quick else "default", args.seed_workload)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    from kvpool.costs.cost_model import fit_step_model

    fit = fit_step_model(doc["samples"], doc["engine"]["q4_rows"])
    print(f"{len(doc['samples'])} steps measured in {doc['wall_s']:.1f} s -> {args.out}; "
          f"linear fit relative RMS error {fit.rel_rmse:.1%}")
    return 0
