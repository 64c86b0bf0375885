"""Up/down state of a remote pool: one warning when it goes down, back-off before retrying.

A pool that is down must not take the server down, nor slow every request by a timeout:
while down, the tier answers misses without touching the network until the back-off ends.
"""

from __future__ import annotations

import logging
import threading
import time

from kvpool.store.tier import TierStats

log = logging.getLogger(__name__)


class PoolHealth:
    """Tracks failures of one remote pool; back-off doubles from `retry_s` up to `max_retry_s`."""

    def __init__(self, name: str, stats: TierStats, retry_s: float = 1.0, max_retry_s: float = 30.0) -> None:
        self.name = name
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.down = False
        self._stats = stats
        self._backoff = retry_s
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def available(self) -> bool:
        """True when up, or when down and the back-off has passed (time for one more try)."""
        return not self.down or time.monotonic() >= self._retry_at

    def failed(self, what: str, error: object) -> None:
        """Count an I/O failure; warn only on the transition from up to down."""
        with self._lock:
            self._stats.errors += 1
            if not self.down:
                log.warning("KV pool %s is unreachable (%s: %s); serving without it, retry in %.1fs",
                            self.name, what, error, self._backoff)
                self.down = True
            else:
                self._backoff = min(self._backoff * 2, self.max_retry_s)
            self._retry_at = time.monotonic() + self._backoff

    def succeeded(self) -> None:
        if self.down:
            with self._lock:
                if self.down:
                    log.info("KV pool %s is reachable again", self.name)
                    self.down = False
                    self._backoff = self.retry_s
