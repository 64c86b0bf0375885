"""TTFT of a prompt whose prefix sits in a slowed disk tier, with and without the
load-or-recompute planner (docs/performance.md). The tier is slowed by a delay injected into each
read; each mode first learns its estimates (one cold run, one store hit), then times `--runs`
repeats of the prompt with the device prefix cache emptied (the store holds the prefix).

    .venv/bin/python scripts/ttft_load_plan.py --tokens 1024 --delay-ms 50 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import step_until_done
from kvpool.engine.loader import load_model
from kvpool.sched.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    engine.scheduler.kv.reset_prefix_cache()
    start = time.perf_counter()
    rid = engine.add_request(prompt, ONE)
    out = step_until_done(engine)[rid]
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    loaded = load_model(None)
    prompt = [(7 * i + 11) % 5000 + 100 for i in range(args.tokens)]
    for mode in ("recompute (no store)", "planner off", "planner on"):
        store = {} if mode.startswith("recompute") else dict(kv_disk_path=tempfile.mkdtemp(), kv_disk_size="1GiB")
        engine = Engine(EngineConfig(num_blocks=512, dtype=args.dtype, **store), loaded=loaded)
        if engine.kv_store is not None:
            engine.kv_store.load_timeout_s = 600.0
            if mode == "planner off":
                engine.scheduler.admission.load_costs = None
        ttft(engine, prompt)  # cold: computes and saves
        if engine.kv_store is not None:
            engine.kv_store.store.flush()
            disk = engine.kv_store.store.tiers[0]
            real_get = disk.get

            def slow_get(key, real_get=real_get):
                time.sleep(args.delay_ms / 1e3)
                return real_get(key)

            disk.get = slow_get
            ttft(engine, prompt)  # a store hit: measures the slowed tier
        runs, priced = [], []
        for _ in range(args.runs):
            est = engine.kv_store.estimates() if engine.kv_store is not None else None
            if est is not None:  # what the planner priced this run at: loading the hit, recomputing it
                reads = est.read.get("disk")
                load_s = len(prompt) // 16 * reads.seconds(est.block_bytes) if reads else 0.0
                priced.append(f"{load_s:.1f}/{est.prefill_s(0, len(prompt)):.1f}")
            runs.append(ttft(engine, prompt))
        times = [t for t, _ in runs]
        print(f"{mode:<22} TTFT median {statistics.median(times):.3f} s  runs "
              f"{', '.join(f'{t:.3f}' for t in times)}  cached tokens {[c for _, c in runs]}"
              f"  est. load/recompute s {priced}", flush=True)
        engine.close()


if __name__ == "__main__":
    main()
