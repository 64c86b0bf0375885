"""`kvpool bench determinism`: one set of greedy requests served alone and on other paths
(batched beside random others, chunked prefill, a prefix hit, recompute and swap preemption,
a host-tier store hit), counting the tokens and logprobs that differ from the solo run.

The contract (docs/determinism.md): a request's greedy tokens and logprobs are the same bits
whatever it is batched with and wherever its KV came from, for one model file, dtype, KV
dtype, block size and machine ISA.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import run_to_completion
from kvpool.engine.loader import LoadedModel, load_model
from kvpool.sched.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Served = tuple[list[int], list[float]]  # a request's greedy tokens and their logprobs


@dataclass(slots=True, frozen=True)
class PathResult:
    path: str
    requests: int
    differing_requests: int
    differing_tokens: int  # positions whose token differs from the solo run
    differing_logprobs: int  # positions whose logprob differs (bitwise) where tokens agree


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, logprobs=0)


def serve(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Served]:
    """Run `prompts` to completion together; each one's (tokens, logprobs)."""
    return [(o.outputs[0].token_ids, list(o.outputs[0].logprobs or []))
            for o in run_to_completion(engine, prompts, params)]


def serve_beside(engine: Engine, target: list[int], others: list[list[int]], params: SamplingParams,
                 others_first: int = 0) -> Served:
    """The target's result when `others` share its steps; `others_first` steps run before it joins."""
    for p in others:
        engine.add_request(p, params)
    for _ in range(others_first):
        if engine.has_unfinished():
            engine.step()
    return serve(engine, [target], params)[0]


def compare(path: str, solo: list[Served], got: list[Served]) -> PathResult:
    tokens = logprobs = requests = 0
    for (st, sl), (gt, gl) in zip(solo, got, strict=True):
        bad_t = sum(a != b for a, b in zip(st, gt, strict=True))
        bad_l = sum(a != b and x == y for a, b, x, y in zip(sl, gl, st, gt, strict=True))
        tokens, logprobs, requests = tokens + bad_t, logprobs + bad_l, requests + bool(bad_t or bad_l)
    return PathResult(path, len(solo), requests, tokens, logprobs)


def random_prompts(rng: np.random.Generator, vocab: int, count: int, lo: int, hi: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in rng.integers(lo, hi + 1, size=count)]


def run_paths(loaded: LoadedModel, dtype: str, targets: list[list[int]], max_tokens: int = 16,
              seed: int = 0, **engine_kw) -> list[PathResult]:
    """Every path's differences from the targets' solo runs."""
    params = greedy(max_tokens)
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(seed)

    def engine(**kw) -> Engine:
        return Engine(EngineConfig(**{"dtype": dtype, "num_blocks": 2048, "block_size": 16, **engine_kw, **kw}),
                      loaded=loaded)

    solo = [serve(engine(), [t], params)[0] for t in targets]
    others = [random_prompts(rng, vocab, int(rng.integers(1, 24)), 4, 300) for _ in targets]
    paths: dict[str, Callable[[], list[Served]]] = {
        "batched": lambda: [serve_beside(engine(), t, o, params) for t, o in zip(targets, others, strict=True)],
        "joins running batch": lambda: [serve_beside(engine(), t, o, params, others_first=3)
                                        for t, o in zip(targets, others, strict=True)],
        "chunked prefill 16": lambda: [serve(engine(max_num_batched_tokens=16), [t], params)[0] for t in targets],
        "chunked prefill 96": lambda: [serve_beside(engine(max_num_batched_tokens=96), t, o, params)
                                       for t, o in zip(targets, others, strict=True)],
        "prefix hit": lambda: _prefix_hits(engine(), targets, params),
        "recompute preemption": lambda: _crowded(engine(num_blocks=40, preemption_mode="recompute"),
                                                 targets, others, params),
        "swap preemption": lambda: _crowded(engine(num_blocks=40, preemption_mode="swap", swap_space="256MiB"),
                                            targets, others, params),
        "host store hit": lambda: _store_hits(engine(kv_host_memory="256MiB", num_blocks=64), targets, rng, vocab,
                                              params),
    }
    return [compare(name, solo, run()) for name, run in paths.items()]


def _prefix_hits(engine: Engine, targets: list[list[int]], params: SamplingParams) -> list[Served]:
    """Each target after a request that shares all but its last few tokens."""
    for t in targets:
        serve(engine, [t[:-3] + [1, 2, 3]], params)
    return [serve(engine, [t], params)[0] for t in targets]


def _crowded(engine: Engine, targets: list[list[int]], others: list[list[int]], params: SamplingParams) -> list[Served]:
    return serve(engine, targets + [p for o in others for p in o[:4]], params)[: len(targets)]


def _store_hits(engine: Engine, targets: list[list[int]], rng: np.random.Generator, vocab: int,
                params: SamplingParams) -> list[Served]:
    """Each target once to store its blocks, then enough others to evict them from the device."""
    serve(engine, targets, params)
    serve(engine, random_prompts(rng, vocab, 4, 200, 250), params)
    return [serve(engine, [t], params)[0] for t in targets]


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or an HF model directory (default: the bundled model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32")
    p.add_argument("--targets", type=int, default=3, help="target requests")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON")


def main(args) -> int:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    loaded = load_model(args.model, dtype=dtype, device=args.device)
    rng = np.random.default_rng(args.seed + 1)
    targets = random_prompts(rng, loaded.config.vocab_size, args.targets, 20, 200)
    results = run_paths(loaded, args.dtype, targets, args.max_tokens, args.seed, device=args.device,
                        model=args.model)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"{'path':<24} {'requests':>8} {'differ':>7} {'tokens':>7} {'logprobs':>9}")
        for r in results:
            print(f"{r.path:<24} {r.requests:>8} {r.differing_requests:>7} {r.differing_tokens:>7} "
                  f"{r.differing_logprobs:>9}")
    return 0 if all(r.differing_tokens == r.differing_logprobs == 0 for r in results) else 1
