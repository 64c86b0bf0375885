"""The peer's side of `kvpool bench determinism`: vLLM-CPU, greedy, each target prompt solo and
then batched beside random others, with and without prefix caching (a second pass over the same
prompts hits the cache). Prints how many targets, tokens and logprobs differ from solo.

Run with the peers' environment (../shared/peers/setup_peers.sh), from /tmp:
    DTYPE=bfloat16 /tmp/vvenv/bin/python /work/main/scripts/vllm_batch_invariance.py
"""

from __future__ import annotations

import os
import random


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    targets = [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 256))] for _ in range(4)]
    others = [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))] for _ in range(24)]
    llm = LLM(
        model=os.environ.get("MODEL", "/tmp/smollm2-hf"),
        dtype=os.environ.get("DTYPE", "bfloat16"),
        max_model_len=2048,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=2 << 30,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)

    def run(prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs
        ]

    solo = []
    for t in targets:
        llm.reset_prefix_cache()
        solo.append(run([t])[0])
    paths = {
        "batched": lambda: run(targets + others)[: len(targets)],
        "batched, prefix hit": lambda: run(others[:8] + targets)[8:],
    }
    print("path                     targets  differ  tokens  logprobs")
    for name, path in paths.items():
        got = path()
        differ = sum(g != s for g, s in zip(got, solo, strict=True))
        tokens = sum(a != b for g, s in zip(got, solo, strict=True) for a, b in zip(g[0], s[0], strict=False))
        logprobs = sum(a != b for g, s in zip(got, solo, strict=True) for a, b in zip(g[1], s[1], strict=False))
        print(f"{name:<24} {len(targets):>7} {differ:>7} {tokens:>7} {logprobs:>9}")


if __name__ == "__main__":
    main()
