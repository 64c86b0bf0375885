"""`kvpool bench kv-accuracy --store-codecs int8+zstd,int4+zstd`: what a lossy store codec costs.

The serving path itself, per codec: an engine whose disk tier packs blocks with the codec serves
each prompt's prefix (the prompt and the first half of the reference output: a conversation's
earlier turn), which write-through saves; the device cache is emptied and the whole reference
text is sent, so the prefix's KV comes back from disk through the codec (dequantized into the
cache's dtype) and the rest is computed over it. Every position after the prefix is scored
teacher-forced from that forward's hidden states: top-1 agreement with, and |logprob delta| of
the reference token against, the same run through the exact codec `none` (so the rows isolate
the codec; the store path itself is exact). Bytes per block are what the tier wrote.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, replace

import numpy as np

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CodecAccuracyRow:
    codec: str
    bytes_per_block: float
    raw_bytes_per_block: int
    ratio: float  # raw (codec none) bytes over stored bytes
    prefix_tokens: int  # store-hit tokens, all prompts
    scored_positions: int
    teacher_forced_top1_agreement: float  # vs the exact codec's run
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float


def _score(engine: Engine, seq: list[int], first: int) -> tuple[dict[int, tuple[float, int]], int]:
    """Per position j >= `first` of `seq`: logprob of seq[j] and the top-1 token, from the forward
    that computed it; and how many tokens came from a cache."""
    scores: dict[int, tuple[float, int]] = {}
    record = engine.controls.record_prompt
    rid = engine.add_request(seq, SamplingParams(max_tokens=1, temperature=0.0))

    def capture(scheduled, runner) -> None:
        record(scheduled, runner)
        rows, next_ids, positions, offset = [], [], [], 0
        for s in scheduled:
            if s.group.request_id == rid:
                for j in range(max(first, s.start + 1), min(s.start + s.num_new_tokens + 1, len(seq))):
                    rows.append(offset + j - 1 - s.start)
                    next_ids.append(seq[j])
                    positions.append(j)
            offset += s.num_new_tokens
        if rows:
            chosen, tops = runner.token_logprobs(rows, next_ids, 1)
            scores.update({j: (lp, top[0][0]) for j, lp, top in zip(positions, chosen, tops, strict=True)})

    engine.controls.record_prompt = capture
    try:
        cached = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    if out.error:
                        raise SystemExit(f"kvpool bench kv-accuracy: scoring failed: {out.error}")
                    cached = out.num_cached_tokens
    finally:
        engine.controls.record_prompt = record
    return scores, cached


def _serve(engine: Engine, prompt: list[int]) -> None:
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()


def _run_codec(base: EngineConfig, loaded, codec: str, seqs: list[list[int]], splits: list[int], disk: str):
    cfg = replace(base, kv_host_memory="0", kv_disk_path=disk, kv_disk_size="8GiB", kv_disk_codec=codec,
                  kv_remote=None)
    engine = Engine(cfg, loaded=loaded)
    B = engine.block_size
    try:
        scores, hit = [], 0
        for seq, split in zip(seqs, splits, strict=True):
            _serve(engine, seq[:split])
            engine.kv_store.store.flush()
            engine.scheduler.kv.reset_prefix_cache()
            got, cached = _score(engine, seq, split + 1)
            if cached != split // B * B:
                raise SystemExit(f"kvpool bench kv-accuracy: codec {codec}: {cached} tokens came from a cache, "
                                 f"expected the prefix's {split // B * B} from disk")
            engine.scheduler.kv.reset_prefix_cache()
            scores.append(got)
            hit += cached
        disk_stats = engine.kv_store.store.stats()["disk"]
        raw = int(np.prod(engine.kv_store.store.block_shape)) * engine.kv_store.store.dtype.itemsize
        return scores, hit, disk_stats.bytes_written / disk_stats.puts, raw
    finally:
        engine.close()


def codec_rows(base: EngineConfig, loaded, codecs: list[str], prompts: list[list[int]],
               outputs: list[list[int]]) -> list[CodecAccuracyRow]:
    """One row per codec (the exact `none` first: every other row is scored against it)."""
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    splits = [len(p) + len(o) // 2 for p, o in zip(prompts, outputs, strict=True)]
    rows, ref = [], None
    with tempfile.TemporaryDirectory(prefix="kvpool-codec-accuracy-") as tmp:
        for codec in ["none"] + [c for c in codecs if c != "none"]:
            logger.info("kv-accuracy: store codec %s", codec)
            scores, hit, stored, raw = _run_codec(base, loaded, codec, seqs, splits, f"{tmp}/{codec}")
            ref = ref or scores
            pairs = [(r[j], s[j]) for r, s in zip(ref, scores, strict=True) for j in r]
            dlp = np.array([abs(a[0] - b[0]) for a, b in pairs])
            agree = float(np.mean([a[1] == b[1] for a, b in pairs]))
            rows.append(CodecAccuracyRow(codec, stored, raw, raw / stored, hit, len(pairs), agree,
                                         float(dlp.mean()), float(dlp.max())))
    return rows


def print_codec_rows(rows: list[CodecAccuracyRow], dtype: str) -> None:
    print(f"store codec accuracy ({dtype} KV): the prefix (prompt + first half of the reference output) "
          "from the disk tier through each codec, the rest teacher-forced; vs codec none")
    print(f"{'codec':<12} {'bytes/block':>11} {'ratio':>6} {'hit tokens':>10} {'scored':>7} {'TF top-1':>9} "
          f"{'mean|dlp|':>10} {'max|dlp|':>9}")
    for r in rows:
        print(f"{r.codec:<12} {r.bytes_per_block:>11.0f} {r.ratio:>6.3f} {r.prefix_tokens:>10} {r.scored_positions:>7} "
              f"{r.teacher_forced_top1_agreement:>9.4f} {r.mean_abs_logprob_diff:>10.5f} {r.max_abs_logprob_diff:>9.4f}")
