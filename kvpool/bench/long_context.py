"""`kvpool bench long-context`: does one long request make every short one pay for its context?

Through `LLM.generate`, greedy, EOS ignored, fresh random prompts each run (no prefix hits):
A = the short prompts alone, C = the long prompt alone, B = all of them in one batch. With
attention at each row's own cost B is about max(A, C) plus the long prefill's share of the
steps, so B / (A + C) <= 1; padding every decode row to the longest context makes it ~7.
"""

from __future__ import annotations

import time

import numpy as np

from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.engine.llm import LLM
from kvpool.sched.sampling_params import SamplingParams


def add_arguments(p) -> None:
    p.add_argument("--num-short", type=int, default=31, help="short requests beside the long one")
    p.add_argument("--short-len", type=int, default=64, help="prompt tokens of each short request")
    p.add_argument("--long-len", type=int, default=3968, help="prompt tokens of the long request")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed-workload", type=int, default=0)
    add_engine_args(p)


def _prompts(rng: np.random.Generator, vocab: int, lens: list[int]) -> list[list[int]]:
    return [rng.integers(0, vocab, size=n).tolist() for n in lens]


def _timed(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main(args) -> int:
    llm = LLM.from_config(engine_config_from_args(args))
    vocab = llm.engine.loaded.config.vocab_size
    rng = np.random.default_rng(args.seed_workload)
    short = [args.short_len] * args.num_short
    _timed(llm, _prompts(rng, vocab, [args.short_len, 300]), 4)  # warm-up: first-call costs
    a = _timed(llm, _prompts(rng, vocab, short + [args.short_len]), args.output_len)
    c = _timed(llm, _prompts(rng, vocab, [args.long_len]), args.output_len)
    b = _timed(llm, _prompts(rng, vocab, short + [args.long_len]), args.output_len)
    cfg = llm.engine.config
    print(f"dtype {cfg.dtype}, block size {cfg.block_size}, max batched tokens {cfg.max_num_batched_tokens}; "
          f"{args.output_len} output tokens each")
    print(f"A  {args.num_short + 1} x {args.short_len}-token prompts alone: {a:.2f} s")
    print(f"C  one {args.long_len}-token prompt alone: {c:.2f} s")
    print(f"B  {args.num_short} short + the long one together: {b:.2f} s")
    print(f"B / (A + C) = {b / (a + c):.2f}   (B / max(A, C) = {b / max(a, c):.2f})")
    return 0
