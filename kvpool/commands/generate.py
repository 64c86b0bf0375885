"""`kvpool generate "prompt" ...`: offline generation from the command line."""

from __future__ import annotations

import json
import sys

from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.sched.sampling_params import SamplingParams


def add_sampling_args(p) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--seed-sampling", type=int, default=None, dest="sampling_seed")
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--beam", action="store_true", help="beam search with --n beams")


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, n=args.n, seed=args.sampling_seed, stop=list(args.stop), use_beam_search=args.beam,
    )


def add_arguments(p) -> None:
    p.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    add_sampling_args(p)
    add_engine_args(p)


def main(args) -> int:
    config = engine_config_from_args(args)  # bad flags fail here, before torch is imported
    params = sampling_from_args(args)
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("kvpool generate: no prompt given", file=sys.stderr)
        return 2
    from kvpool.engine.llm import LLM

    llm = LLM.from_config(config)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        for o in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": o.index, "text": o.text,
                                  "finish_reason": o.finish_reason, "cached_tokens": out.num_cached_tokens}))
            else:
                print(f"{prompt}{o.text}" if not args.chat else o.text)
                print("-" * 40)
    return 0
