"""`kvpool bench kv-accuracy`: what each KV dtype costs in accuracy against full-precision KV.

For each English prompt the reference engine (model dtype, KV in the model dtype; float32 by
default) generates `--output-len` greedy tokens. Every other KV dtype then
- generates freely (greedy): tokens equal to the reference's, and where they first differ;
- scores the reference's text teacher-forced (prompt logprobs over prompt + reference output,
  one prefill that reads the quantized K/V of every earlier token, as decode does): top-1
  agreement with the reference token and mean |logprob(reference token) - reference logprob|
  over the generated positions (no divergence cascade, so one number per token).
`--scales-study` adds simulated int8 / fp8 runs with per block-and-head scales (an oracle that
requantizes a block from full precision at every write, i.e. the best any per-block scheme can
do) beside per token-and-head ones, which is how kv_quant.py's choice was made. The lossless
store codecs (none | zstd | zstd-shuffle) return the reference's own KV; `--store-codecs` scores
the lossy ones (int8, int4, +zstd) on the serving path (kv_codec_accuracy.py).
Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from unittest import mock

import numpy as np
import torch

from kvpool.bench.kv_codec_accuracy import CodecAccuracyRow, codec_rows, print_codec_rows
from kvpool.engine.attention import paged_attention
from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.engine.engine import Engine
from kvpool.engine.kv_quant import QUANTIZED, dequantize, quantize
from kvpool.engine.llm import run_to_completion
from kvpool.engine.loader import load_model
from kvpool.sched.sampling_params import SamplingParams
from kvpool.store.codec import get_codec

logger = logging.getLogger(__name__)

_CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    _CHAT.format("Explain, step by step, how a public library lends a book and gets it back."),
    _CHAT.format("Write a short story about a lighthouse keeper who finds a message in a bottle."),
    _CHAT.format("What are the main causes of the seasons on Earth? Answer in a few paragraphs."),
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses were running in "
    "more than two hundred European cities, and the price of books fell sharply. The consequences",
]


@dataclass(slots=True)
class AccuracyRow:
    kv_cache_dtype: str
    scales: str  # per-token-head (the implementation) | per-block-head (oracle, simulated) | -
    greedy_tokens_equal: float  # fraction of generated positions equal to the reference's
    first_divergence: list[int | None]  # per prompt: first differing generated token (None: none)
    teacher_forced_top1_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    bytes_per_token: int | None = None


def _generate(engine: Engine, prompts: list[str], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in _run(engine, prompts, params)]


def _teacher_forced(engine: Engine, sequences: list[list[int]], start: list[int]) -> tuple[list, list]:
    """Per sequence: logprob of each token from position start[i] on, and the top-1 token there."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    chosen, top = [], []
    for out, s in zip(_run(engine, sequences, params), start, strict=True):
        chosen.append(np.array(out.prompt_logprobs[s:], dtype=np.float64))
        top.append([t[0][0] for t in out.prompt_top_logprobs[s:]])
    return chosen, top


def _run(engine: Engine, prompts, params):
    outs = run_to_completion(engine, prompts, params)
    engine.scheduler.kv.reset_prefix_cache()  # the next pass computes its own KV
    return outs


@contextmanager
def simulated_scales(kv: str):
    """Float caches holding int8 / fp8 values dequantized with per block-and-head scales,
    recomputed from a full-precision shadow of the block at every write."""
    cache_dtype = QUANTIZED[kv]
    shadows: dict[int, torch.Tensor] = {}

    def write(key, value, k_cache, v_cache, slot_mapping):
        hkv, d = k_cache.shape[-2:]
        for x, cache in ((key, k_cache), (value, v_cache)):
            shadow = shadows.setdefault(id(cache), torch.zeros_like(cache))
            block_size = cache.shape[1]
            shadow[slot_mapping[slot_mapping % block_size == 0] // block_size] = 0  # a block's first write: forget its old life
            shadow.view(-1, hkv, d).index_copy_(0, slot_mapping, x.to(shadow.dtype))
            blocks = torch.unique(slot_mapping // block_size)
            rows = shadow.index_select(0, blocks)  # [n, B, Hkv, D]
            per_head = rows.transpose(1, 2).reshape(len(blocks), hkv, -1)  # a block-and-head's values
            packed = quantize(per_head, cache_dtype)  # one scale per block and head
            cache.index_copy_(0, blocks, dequantize(packed).view(len(blocks), hkv, -1, d).transpose(1, 2))

    def attend(*args, new_kv=None, **kw):  # like a quantized cache: fresh prompts read the stored values
        return paged_attention(*args, **kw)

    with mock.patch("kvpool.engine.models.llama.write_kv", write), \
            mock.patch("kvpool.engine.models.llama.paged_attention", attend):
        yield


def _row(kv: str, scales: str, ref_tokens, tokens, ref_lp, lp, ref_top, top, bpt) -> AccuracyRow:
    equal = [sum(a == b for a, b in zip(r, t, strict=True)) for r, t in zip(ref_tokens, tokens, strict=True)]
    first = [next((i for i, (a, b) in enumerate(zip(r, t, strict=True)) if a != b), None)
             for r, t in zip(ref_tokens, tokens, strict=True)]
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(ref_lp, lp, strict=True)])
    agree = [a == b for r, t in zip(ref_top, top, strict=True) for a, b in zip(r, t, strict=True)]
    total = sum(len(r) for r in ref_tokens)
    return AccuracyRow(kv, scales, sum(equal) / total, first, float(np.mean(agree)), float(diffs.mean()),
                       float(diffs.max()), bpt)


def add_arguments(p) -> None:
    p.add_argument("--output-len", type=int, default=256, help="greedy tokens generated per prompt")
    p.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3,int8", help="KV dtypes compared with the reference")
    p.add_argument("--scales-study", action="store_true",
                   help="also simulate int8 / fp8 with per block-and-head scales (an oracle)")
    p.add_argument("--store-codecs", default="",
                   help="comma list of store codecs (int8+zstd,int4+zstd,...): score a prefix that comes back "
                   "from the disk tier through each, against the exact codec (kv_codec_accuracy.py)")
    p.add_argument("--json", default="kv_accuracy.json")
    p.add_argument("--png", default="kv_accuracy.png", help="write the agreement plot here")
    add_engine_args(p)
    p.set_defaults(dtype="float32")  # full precision: the reference is fp32 weights and KV


def main(args) -> int:
    base = engine_config_from_args(args)
    loaded = load_model(base.model, dtype=torch.float32 if base.dtype == "float32" else torch.bfloat16)
    tok = loaded.tokenizer
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    n = args.output_len
    need = sum(len(p) + n for p in prompt_ids) // base.block_size + 2 * len(PROMPTS) + 8
    base = replace(base, num_blocks=max(base.num_blocks or 0, need), kv_cache_dtype=base.dtype)

    def engine(kv: str) -> Engine:
        return Engine(replace(base, kv_cache_dtype=kv), loaded=loaded)

    start = time.perf_counter()
    ref = engine(base.dtype)
    ref_tokens = _generate(ref, prompt_ids, n)
    seqs = [p + t for p, t in zip(prompt_ids, ref_tokens, strict=True)]
    starts = [len(p) for p in prompt_ids]
    ref_lp, ref_top = _teacher_forced(ref, seqs, starts)
    rows = [_row(base.dtype, "-", ref_tokens, ref_tokens, ref_lp, ref_lp, ref_top, ref_top, _bpt(ref))]
    codecs = [c for c in args.store_codecs.split(",") if c]
    for c in codecs:
        get_codec(c, "--store-codecs")
    runs = [(kv, "per-token-head" if kv in QUANTIZED else "-", None) for kv in args.kv_dtypes.split(",") if kv]
    if args.scales_study:
        runs += [(kv, "per-block-head", "per-block-head") for kv in QUANTIZED]
    for kv, scales, simulated in runs:
        logger.info("kv-accuracy: %s %s%s", kv, scales, " (simulated)" if simulated else "")
        if simulated:
            with simulated_scales(kv):
                eng = engine(base.dtype)
                tokens = _generate(eng, prompt_ids, n)
                lp, top = _teacher_forced(eng, seqs, starts)
            label = f"{scales} (simulated)"
        else:
            eng = engine(kv)
            tokens = _generate(eng, prompt_ids, n)
            lp, top = _teacher_forced(eng, seqs, starts)
            label = scales
        rows.append(_row(kv, label, ref_tokens, tokens, ref_lp, lp, ref_top, top, None if simulated else _bpt(eng)))
        _write(args.json, loaded.name, base.dtype, n, ref_tokens, time.perf_counter() - start, rows)  # row by row
    _print(rows, len(PROMPTS), n, base.dtype)
    store_rows = codec_rows(base, loaded, codecs, prompt_ids, ref_tokens) if codecs else []
    if store_rows:
        print_codec_rows(store_rows, base.dtype)
    _write(args.json, loaded.name, base.dtype, n, ref_tokens, time.perf_counter() - start, rows, store_rows)
    if len(rows) > 1:
        _plot(rows, args.png, base.dtype)
    print(f"wrote {args.json}" + (f" and {args.png}" if len(rows) > 1 else ""))
    return 0


def _write(path: str, model: str, dtype: str, n: int, ref_tokens, elapsed: float, rows: list[AccuracyRow],
           store_rows: list[CodecAccuracyRow] = ()) -> None:
    report = {"model": model, "model_dtype": dtype, "prompts": len(PROMPTS), "output_len": n,
              "generated_tokens": sum(len(t) for t in ref_tokens), "elapsed_s": elapsed,
              "rows": [asdict(r) for r in rows], "store_codec_rows": [asdict(r) for r in store_rows]}
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def _bpt(engine: Engine) -> int:
    return sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches) // (engine.runner.kv_caches[0][0].shape[0]
                                                                             * engine.block_size)


def _print(rows: list[AccuracyRow], prompts: int, n: int, ref: str) -> None:
    print(f"KV dtype accuracy vs {ref} KV: {prompts} English prompts x {n} greedy tokens")
    print(f"{'kv dtype':<10} {'scales':<30} {'B/token':>8} {'greedy equal':>12} {'first diff':>18} "
          f"{'TF top-1':>9} {'mean|dlp|':>10} {'max|dlp|':>9}")
    for r in rows:
        first = ",".join("-" if f is None else str(f) for f in r.first_divergence)
        bpt = "" if r.bytes_per_token is None else str(r.bytes_per_token)
        print(f"{r.kv_cache_dtype:<10} {r.scales:<30} {bpt:>8} {r.greedy_tokens_equal:>12.3f} {first:>18} "
              f"{r.teacher_forced_top1_agreement:>9.4f} {r.mean_abs_logprob_diff:>10.5f} {r.max_abs_logprob_diff:>9.4f}")


def _plot(rows: list[AccuracyRow], path: str, ref: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows[1:]
    labels = [f"{r.kv_cache_dtype}\n{r.scales.replace(' (simulated)', '*')}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(rows))
    a.bar(x - 0.2, [r.greedy_tokens_equal for r in rows], 0.4, label="free-running greedy tokens equal")
    a.bar(x + 0.2, [r.teacher_forced_top1_agreement for r in rows], 0.4, label="teacher-forced top-1 agreement")
    a.set_ylim(0, 1.05)
    a.set_xticks(x, labels, fontsize=7)
    a.set_title(f"agreement with {ref} KV")
    a.legend(fontsize=7, loc="lower left")
    b.bar(x, [r.mean_abs_logprob_diff for r in rows])
    b.set_xticks(x, labels, fontsize=7)
    b.set_yscale("log")
    b.set_title("mean |logprob diff| of the reference token")
    fig.suptitle("KV cache dtype accuracy (* simulated scales)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
