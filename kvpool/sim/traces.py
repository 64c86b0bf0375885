"""Mooncake open traces (FAST'25) as simulator requests.

Each line: {"timestamp": ms, "input_length", "output_length", "hash_ids": one id per 512-token
block}. Hash id h becomes chunk h: 512 deterministic tokens (fewer for the partial last block),
so equal hash ids give equal tokens and equal chained block hashes at any simulated block size.
With `scale_lengths` < 1 (a small model) each hash id stands for round(512 * scale) tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.core.hashing import BlockHash
from kvpool.errors import ConfigError
from kvpool.sim.tokens import BlockHasher, TokenSynth
from kvpool.sim.workloads import OUTPUT_CHUNK_BASE, SimRequest

logger = logging.getLogger(__name__)

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE_DIR = Path("/work/shared/traces/mooncake")
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}


@dataclass(slots=True, frozen=True)
class TraceOptions:
    """How to adapt a trace: first `max_requests`, arrivals divided by `speedup`, lengths
    multiplied by `scale_lengths`, prompts truncated to `max_prompt_len` tokens (after scaling),
    and the whole `repeat` times in a row: each copy follows the last at the trace's own pace
    (its span plus one mean gap) with its hash ids shifted past every earlier one, so copies share
    no blocks and a run of k copies is a k times longer run of the same load."""

    max_requests: int | None = None
    speedup: float = 1.0
    scale_lengths: float = 1.0
    max_prompt_len: int | None = None
    repeat: int = 1

    def __post_init__(self) -> None:
        if self.speedup <= 0 or not 0 < self.scale_lengths <= 1:
            raise ConfigError(
                f"speedup={self.speedup} must be > 0 and scale_lengths={self.scale_lengths} in (0, 1]"
            )
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ConfigError(f"max_prompt_len={self.max_prompt_len} must be >= 1")
        if self.repeat < 1:
            raise ConfigError(f"repeat={self.repeat} must be >= 1")


def trace_path(name_or_path: str | Path) -> Path:
    """A trace by short name ('conversation', 'synthetic') or by file path."""
    if str(name_or_path) in TRACES:
        return DEFAULT_TRACE_DIR / TRACES[str(name_or_path)]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"trace {name_or_path!r} is neither a file nor one of {sorted(TRACES)}")
    return path


def load_mooncake_trace(name_or_path: str | Path, options: TraceOptions | None = None) -> list[SimRequest]:
    """Requests of a Mooncake trace, arrival times in seconds from the first request."""
    opts = options or TraceOptions()
    chunk_tokens = max(1, round(TRACE_BLOCK_TOKENS * opts.scale_lengths))
    records = []
    with trace_path(name_or_path).open() as f:
        for i, line in enumerate(f):
            if opts.max_requests is not None and i >= opts.max_requests:
                break
            records.append(json.loads(line))
    if not records:
        return []
    t0 = records[0]["timestamp"]
    span_ms = records[-1]["timestamp"] - t0
    period_ms = span_ms + span_ms / max(len(records) - 1, 1)  # the span plus one mean gap
    id_shift = 1 + max(h for rec in records for h in rec["hash_ids"])
    reqs: list[SimRequest] = []
    for copy in range(opts.repeat):
        for rec in records:
            i = len(reqs)
            prompt_len = max(1, round(rec["input_length"] * opts.scale_lengths))
            if opts.max_prompt_len is not None:
                prompt_len = min(prompt_len, opts.max_prompt_len)
            ids = [h + copy * id_shift for h in rec["hash_ids"][: -(-prompt_len // chunk_tokens)]]
            # If rounding leaves more tokens than ids cover, the last chunk runs longer.
            last = prompt_len - chunk_tokens * (len(ids) - 1)
            chunks = tuple((h, chunk_tokens) for h in ids[:-1]) + ((ids[-1], last),)
            reqs.append(
                SimRequest(
                    request_id=f"trace-{i}",
                    arrival_s=(rec["timestamp"] - t0 + copy * period_ms) / 1000.0 / opts.speedup,
                    prompt_len=prompt_len,
                    output_len=max(1, round(rec["output_length"] * opts.scale_lengths)),
                    chunks=chunks,
                    output_chunk=OUTPUT_CHUNK_BASE + i,
                )
            )
    logger.info("loaded %d requests from %s", len(reqs), name_or_path)
    return reqs


def block_hashes_for(
    requests: Sequence[SimRequest],
    block_size: int,
    synth: TokenSynth | None = None,
) -> list[list[BlockHash]]:
    """Keys of every full prompt block of each request, from one `BlockHasher`: blocks share a
    key exactly when the KV manager's chained hashes of `TokenSynth.tokens(request.chunks)` agree."""
    hasher = BlockHasher(block_size, synth or TokenSynth())
    return [hasher.hashes(r.chunks) for r in requests]
