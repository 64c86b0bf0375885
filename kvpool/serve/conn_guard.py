"""Connection-level limits uvicorn lacks: a deadline for a request's headers and one for its body,
and a cap on concurrent connections per client address.

uvicorn bounds only the idle time between keep-alive requests (`--timeout-keep-alive`). A client
that opens a socket and sends nothing, trickles its headers a byte at a time, or declares a
`Content-Length` and stops would keep its connection (and a file descriptor) forever, and one
host could hold them all. `guarded_h11` returns uvicorn's h11 protocol with those deadlines and
the per-address cap; a connection that misses a deadline or is over the cap is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Seconds a request's headers (from the connection or the request's first byte) and its body
    (from the end of the headers) may take; connections one address may hold (0: no cap)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_per_client: int = 512

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("header and body timeouts must be > 0")
        if self.max_per_client < 0:
            raise ValueError("max_per_client must be >= 0")


def guarded_h11(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol subclass enforcing `limits`; its per-address counts are shared by every
    connection of the server it is given to."""
    open_per_client: Counter[str] = Counter()

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None
        _counted: str | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            if host is not None and limits.max_per_client:
                if open_per_client[host] >= limits.max_per_client:
                    logger.warning("refused a connection from %s: it holds %d (--max-connections-per-client)",
                                   host, open_per_client[host])
                    transport.close()
                    return
                open_per_client[host] += 1
                self._counted = host
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._set_phase(None)
            if self._counted is not None:
                open_per_client[self._counted] -= 1
                if open_per_client[self._counted] <= 0:
                    del open_per_client[self._counted]
                self._counted = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already buffered
            self._arm()

        def _arm(self) -> None:
            """Headers pending (nothing parsed yet, or a request begun) or body pending: that phase's
            deadline runs; otherwise (the app has the request, or the line is idle) none does."""
            state = self.conn.their_state
            if state is h11.IDLE and (self._phase == "headers" or self.conn.trailing_data[0] or self.cycle is None):
                self._set_phase("headers")
            elif state is h11.SEND_BODY:
                self._set_phase("body")
            else:
                self._set_phase(None)

        def _set_phase(self, phase: str | None) -> None:
            if phase == self._phase:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None and not self.transport.is_closing():
                timeout = limits.header_timeout_s if phase == "headers" else limits.body_timeout_s
                self._timer = self.loop.call_later(timeout, self._expired, phase)

        def _expired(self, phase: str) -> None:
            self._timer = None
            if self._phase == phase and not self.transport.is_closing():
                logger.debug("closing %s: its request %s did not arrive in time", self.client, phase)
                self.transport.close()

    return GuardedH11Protocol
