"""`kvpool serve --record-requests FILE`: one JSON line per finished request, what `kvpool sim
replay` needs to run the same load through the simulator (kvpool/sim/replay.py).

A line holds no text and no token ids: the arrival (seconds since the server started), the
prompt's full blocks as their salted chained hashes (hex; equal prefixes have equal hashes, as in
the Mooncake traces' hash ids), the prompt and output lengths, the tenant scope (a digest of the
salt, never the salt), and what the server measured: cached tokens, TTFT, and where the prompt's
KV came from (`sources`, `misses`: kvpool/core/miss_reasons.py)::

    {"v": 1, "arrival_s": 0.52, "block_size": 16, "block_hashes": ["9f3c...", ...],
     "prompt_len": 70, "output_len": 8, "scope": null, "cached_tokens": 64, "ttft_s": 0.031,
     "sources": {"device": 64}, "misses": {"partial_block": 6}}
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from kvpool.engine.outputs import RequestOutput
from kvpool.errors import ConfigError

RECORD_VERSION = 1


class RequestRecorder:
    """Appends a line per finished request to `path` (truncated at start), flushed at once so
    a crash loses nothing already finished. Called on the engine thread."""

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
        line = {
            "v": RECORD_VERSION, "arrival_s": round(m.arrival_s - self.origin, 6), "block_size": self.block_size,
            "block_hashes": [h.hex() for h in split.hashes] if split is not None else [],
            "prompt_len": len(out.prompt_token_ids), "output_len": len(m.token_times),
            "scope": split.scope if split is not None else None, "cached_tokens": out.num_cached_tokens,
            "ttft_s": round(m.token_times[0] - m.arrival_s, 6) if m.token_times else None,
            "sources": split.sources if split is not None else {},
            "misses": dict(split.misses) if split is not None else {},
        }
        with self._lock:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._file.flush()
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()
