"""`kvpool bench throughput`: offline batch throughput, modelled on `vllm bench throughput`.

Default workload: 32 requests of random token ids (seed 0), prompt lengths uniform in
[32, 256], exactly 64 output tokens each (EOS ignored), greedy. Reports tokens/s, the KV
usage at peak, this machine's limits measured in the same run (best matmul rate over fp32 and
bf16, the rate of the dtype in use, DRAM read bandwidth; see bench/limits.py), the fraction of
the best matmul rate reached (model FLOPs: 2 x parameters x processed tokens, LM head
included), and the workload's floor time with the fraction of it reached (floor / elapsed).
`--peer hf` runs HF transformers' batched generate on the same workload in the same process.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from kvpool.bench.limits import MachineLimits, describe, floor_seconds, measure_limits
from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ThroughputResult:
    system: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    achieved_gflops: float
    matmul_gflops: float  # the rate of the dtype this system ran in
    fraction_of_compute_limit: float  # of the best matmul rate over fp32 and bf16
    best_matmul_gflops: float
    dram_read_gbps: float
    floor_s: float
    fraction_of_floor: float  # floor_s / elapsed_s
    peak_kv_blocks_used: int | None = None
    peak_kv_token_fraction_of_allocated: float | None = None
    mean_token_fraction_of_allocated: float | None = None
    preemptions: int | None = None
    kv_cache_dtype: str | None = None
    kv_blocks: int | None = None
    peak_running_seqs: int | None = None  # the concurrency the KV budget allowed
    mean_running_seqs: float | None = None


def make_workload(num: int, min_in: int, max_in: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_in, max_in + 1, size=num)
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lens]


def flops_per_token(engine_or_config) -> int:
    cfg = engine_or_config
    emb = cfg.vocab_size * cfg.hidden_size
    return 2 * (cfg.num_parameters() - emb + (emb if cfg.tie_word_embeddings else 0))


def _result(system: str, prompts: list[list[int]], out_tokens: int, output_len: int, elapsed: float, cfg,
            limits: MachineLimits, dtype: str, **extra) -> ThroughputResult:
    prompt_tokens = sum(len(p) for p in prompts)
    processed = prompt_tokens + out_tokens - len(prompts)
    fpt = flops_per_token(cfg)
    achieved = fpt * processed / elapsed / 1e9
    floor = floor_seconds(limits, fpt, cfg.num_parameters(), [len(p) for p in prompts], output_len)
    return ThroughputResult(
        system, len(prompts), prompt_tokens, out_tokens, elapsed, out_tokens / elapsed,
        (prompt_tokens + out_tokens) / elapsed, achieved, limits.matmul_gflops.get(dtype, float("nan")),
        achieved / limits.best_gflops, limits.best_gflops, limits.dram_read_gbps, floor, floor / elapsed, **extra,
    )


def run_kvpool(engine: Engine, prompts: list[list[int]], output_len: int, limits: MachineLimits) -> ThroughputResult:
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    kv = engine.scheduler.kv
    peak_used, peak_frac, fracs, running = 0, 1.0, [], []
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="kvpool", unit="req", leave=False)
    out_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():  # each step's new tokens
            out_tokens += sum(len(o.token_ids) for o in out.outputs)
            if out.finished:
                bar.update(1)
        running.append(engine.scheduler.num_running_seqs)
        u = kv.usage()
        if u.used_blocks:
            fracs.append(u.token_fraction_of_allocated)
        if u.used_blocks > peak_used:
            peak_used, peak_frac = u.used_blocks, u.token_fraction_of_allocated
    elapsed = time.perf_counter() - start
    bar.close()
    return _result(
        "kvpool", prompts, out_tokens, output_len, elapsed, engine.loaded.config, limits, engine.config.dtype,
        peak_kv_blocks_used=peak_used, peak_kv_token_fraction_of_allocated=peak_frac,
        mean_token_fraction_of_allocated=float(np.mean(fracs)) if fracs else None,
        preemptions=engine.scheduler.num_preemptions, kv_cache_dtype=engine.kv_dtype,
        kv_blocks=engine.scheduler.config.num_blocks, peak_running_seqs=max(running, default=0),
        mean_running_seqs=float(np.mean(running)) if running else None,
    )


def run_hf(model_path: str, prompts: list[list[int]], output_len: int, limits: MachineLimits, cfg, batch: int = 8):
    """HF transformers' batched greedy generate on the same workload (left padding)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    pad = 0
    start = time.perf_counter()
    out_tokens = 0
    for i in tqdm(range(0, len(prompts), batch), desc="hf", leave=False):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        out_tokens += (res.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - start
    return _result("hf-transformers", prompts, out_tokens, output_len, elapsed, cfg, limits, "float32")


def add_arguments(p) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed-workload", type=int, default=0)
    p.add_argument("--peer", choices=["hf"], default=None, help="also run HF transformers on the same workload")
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--json", default=None, help="write results as JSON here")
    add_engine_args(p)


def _print(r: ThroughputResult) -> None:
    print(f"{r.system}: {r.requests} requests in {r.elapsed_s:.2f} s | output {r.output_tokens_per_s:.1f} tok/s | "
          f"total {r.total_tokens_per_s:.1f} tok/s | {r.achieved_gflops:.1f} GFLOP/s = "
          f"{r.fraction_of_compute_limit:.2f} of the best matmul rate ({r.best_matmul_gflops:.0f} GFLOP/s; "
          f"{r.matmul_gflops:.0f} in its dtype)")
    print(f"  workload floor {r.floor_s:.2f} s (best matmul rate, weights streamed at "
          f"{r.dram_read_gbps:.1f} GB/s per decode step): {r.fraction_of_floor:.2f} of the floor reached")
    if r.peak_kv_blocks_used is not None:
        print(f"  KV at peak: {r.peak_kv_blocks_used} blocks used, {r.peak_kv_token_fraction_of_allocated:.1%} of "
              f"allocated slots hold tokens (mean over steps {r.mean_token_fraction_of_allocated:.1%}); "
              f"preemptions {r.preemptions}")
        print(f"  KV dtype {r.kv_cache_dtype}: {r.kv_blocks} blocks; running sequences peak {r.peak_running_seqs}, "
              f"mean {r.mean_running_seqs:.1f}")


def main(args) -> int:
    engine = Engine(engine_config_from_args(args))
    prompts = make_workload(args.num_prompts, args.input_len_min, args.input_len_max,
                            engine.loaded.config.vocab_size, args.seed_workload)
    limits = measure_limits(engine.device)
    print(f"{describe(limits, engine.config.dtype)}; model {flops_per_token(engine.loaded.config) / 1e6:.0f} "
          f"MFLOP/token")
    results = [run_kvpool(engine, prompts, args.output_len, limits)]
    _print(results[0])
    if args.peer == "hf":
        results.append(run_hf(str(engine.loaded.path), prompts, args.output_len, limits, engine.loaded.config,
                              args.hf_batch))
        _print(results[1])
        print(f"kvpool / hf output throughput: {results[0].output_tokens_per_s / results[1].output_tokens_per_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2, sort_keys=True)
    return 0
