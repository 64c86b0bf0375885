"""How often bf16 greedy decoding picks fp32's token on the bundled model (docs/architecture.md).

fp32 generates greedily from real prompts; then (1) teacher-forced: bf16 reads the prompt and
fp32's continuation in one forward pass and we count the positions where its argmax is fp32's
next token; (2) free-running: bf16 generates on its own and we count tokens equal to fp32's
before the first difference. Usage: PYTHONPATH=. python scripts/bf16_agreement.py [tokens]
"""

from __future__ import annotations

import sys

import torch

from kvpool import LLM
from kvpool.engine.attention import AttentionMetadata
from kvpool.engine.models.llama import allocate_kv_caches
from kvpool.sched.sampling_params import SamplingParams

PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main causes of the French Revolution?",
    "Give me a short recipe for pancakes.",
]


@torch.inference_mode()
def teacher_forced_argmax(llm: LLM, tokens: list[int]) -> list[int]:
    """The model's greedy next token after every prefix of `tokens`, in one prefill."""
    model, cfg, block = llm.engine.runner.model, llm.engine.loaded.config, 16
    blocks = -(-len(tokens) // block)
    caches = allocate_kv_caches(cfg, blocks, block, llm.engine.dtype, "cpu")
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(blocks))], block)
    hidden = model(torch.tensor(tokens), meta.positions, caches, meta)[: len(tokens)]
    return model.compute_logits(hidden).argmax(-1).tolist()


def main(max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, num_blocks=512)
        outs = llm.chat(chats, params, use_tqdm=False)
        runs[dtype] = (llm, [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs])
    forced = free = total = 0
    bf16 = runs["bfloat16"][0]
    for (prompt, ref), (_, own) in zip(runs["float32"][1], runs["bfloat16"][1], strict=True):
        picks = teacher_forced_argmax(bf16, list(prompt) + list(ref[:-1]))[len(prompt) - 1 :]
        forced += sum(a == b for a, b in zip(picks, ref, strict=True))
        free += next((i for i, (a, b) in enumerate(zip(own, ref, strict=True)) if a != b), len(ref))
        total += len(ref)
    print(f"{len(PROMPTS)} chat prompts x {max_tokens} greedy tokens = {total} tokens")
    print(f"teacher-forced: bf16 argmax == fp32 token at {forced}/{total} positions ({forced / total:.1%})")
    print(f"free-running: {free}/{total} tokens ({free / total:.1%}) equal before each prompt's first difference")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
