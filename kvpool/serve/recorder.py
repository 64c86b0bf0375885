"""`kvpool serve --record-requests FILE`: one JSON line per finished request, what `kvpool sim
replay` needs to run the same load through the simulator (kvpool/sim/replay.py).

A line holds no text and no token ids: the arrival (seconds since the server started), the
prompt's full blocks as their salted chained hashes (hex; equal prefixes have equal hashes, as in
the Mooncake traces' hash ids), the prompt and output lengths, the tenant scope (a digest of the
salt, never the salt), what the request asked to keep (`retention`: per `cache_control` /
`kvpool_retention` entry, the full blocks it covers from the first, its TTL in seconds or null for
a pin, its priority), and what the server measured: cached tokens, TTFT, and where the prompt's KV
came from (`sources`, `misses`: kvpool/core/miss_reasons.py)::

    {"v": 2, "arrival_s": 0.52, "block_size": 16, "block_hashes": ["9f3c...", ...],
     "prompt_len": 70, "output_len": 8, "scope": null,
     "retention": [{"blocks": 4, "ttl_s": 300.0, "priority": 0}], "cached_tokens": 64,
     "ttft_s": 0.031, "sources": {"device": 64}, "misses": {"partial_block": 6}}

An operator's pin or unpin (`POST /v1/kv/pin`, `/v1/kv/unpin`) is a line of its own kind: when,
the blocks it covers (hashes, as above), and a pin's TTL and priority::

    {"v": 2, "kind": "pin", "at_s": 0.1, "block_size": 16, "block_hashes": [...], "ttl_s": null,
     "priority": 50}
    {"v": 2, "kind": "unpin", "at_s": 9.3, "block_size": 16, "block_hashes": [...]}

Version 1 lines (no `retention`, no pins) are still read.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvpool.core.hashing import BlockHash
from kvpool.core.retention import RetentionRequest, prefix_blocks
from kvpool.engine.outputs import RequestOutput
from kvpool.errors import ConfigError

RECORD_VERSION = 2


class RequestRecorder:
    """Appends a line per finished request (or pin) to `path` (truncated at start), flushed at
    once so a crash loses nothing already finished. Called on the engine thread."""

    def __init__(self, path: str | Path, block_size: int, origin: float | None = None) -> None:
        path = Path(path)
        if not path.parent.is_dir():
            raise ConfigError(f"--record-requests {path}: directory {path.parent} does not exist")
        try:
            self._file = path.open("w", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--record-requests {path}: {e.strerror}") from None
        self.path = path
        self.block_size = block_size
        self.origin = time.monotonic() if origin is None else origin  # the engine's arrival clock
        self._lock = threading.Lock()
        self.num_records = 0

    def record(self, out: RequestOutput) -> None:
        m = out.metrics
        split = m.prompt_sources
        hashes = split.hashes if split is not None else []
        line = {
            "v": RECORD_VERSION, "arrival_s": round(m.arrival_s - self.origin, 6), "block_size": self.block_size,
            "block_hashes": [h.hex() for h in hashes],
            "prompt_len": len(out.prompt_token_ids), "output_len": len(m.token_times),
            "scope": split.scope if split is not None else None,
            "retention": [{"blocks": prefix_blocks(r.prefix_tokens, len(hashes), self.block_size),
                           "ttl_s": r.ttl_s, "priority": r.priority} for r in m.retention_param],
            "cached_tokens": out.num_cached_tokens,
            "ttft_s": round(m.token_times[0] - m.arrival_s, 6) if m.token_times else None,
            "sources": split.sources if split is not None else {},
            "misses": dict(split.misses) if split is not None else {},
        }
        self._write(line)

    def record_pin(self, at: float, hashes: Sequence[BlockHash], retention: RetentionRequest) -> None:
        """A pin at `at` (the engine's clock) of a prompt whose full blocks are `hashes` (its
        group-0 chained hashes); the line holds the blocks `retention` covers."""
        n = prefix_blocks(retention.prefix_tokens, len(hashes), self.block_size)
        self._write({"v": RECORD_VERSION, "kind": "pin", "at_s": round(at - self.origin, 6),
                     "block_size": self.block_size, "block_hashes": [h.hex() for h in hashes[:n]],
                     "ttl_s": retention.ttl_s, "priority": retention.priority})

    def record_unpin(self, at: float, hashes: Sequence[BlockHash], prefix_tokens: int | None) -> None:
        """An unpin at `at` of the full blocks `hashes` within the prompt's first `prefix_tokens`."""
        n = prefix_blocks(prefix_tokens, len(hashes), self.block_size)
        self._write({"v": RECORD_VERSION, "kind": "unpin", "at_s": round(at - self.origin, 6),
                     "block_size": self.block_size, "block_hashes": [h.hex() for h in hashes[:n]]})

    def _write(self, line: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._file.flush()
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()
