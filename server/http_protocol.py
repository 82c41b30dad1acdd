"""uvicorn's h11 protocol with a deadline on request headers.

uvicorn (h11) closes idle kept-alive connections (`timeout_keep_alive`) but waits forever for the
headers of a request that has begun, so connections that send partial headers pile up. Here a
connection must deliver a request's complete headers within `header_timeout` seconds: counted
from the moment it opens, and on a kept-alive connection from the first byte of the next request.
Past the deadline the connection is closed. (Bodies have their own timeout: server/limits.py.)

It also caps open connections (server/connections.py): past `max_connections` a connection is answered
503, and past that plus BUSY_CONNECTIONS closed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from server.connections import BUSY_CONNECTIONS, RateLimitedLog, busy_app

REFUSED = RateLimitedLog("refusing connections: %d open, more than --max-connections %d")


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # set by `h11_protocol_with_header_timeout`
    max_connections: int | None = None  # None: no cap

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        limit = self.max_connections
        if limit is not None and len(self.connections) > limit:
            REFUSED.event(len(self.connections), limit)
            if len(self.connections) > limit + BUSY_CONNECTIONS:
                transport.close()  # its file descriptor is free at once; connection_lost follows
                return
            self.app = busy_app(self.app, limit)  # a 503 answer (probes still served)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm_header_timer()  # a kept-alive connection starts its next request
        super().data_received(data)
        self._check_headers_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request from buffered bytes
        if self._between_requests() and self.conn.trailing_data[0] and not self.transport.is_closing():
            self._arm_header_timer()  # part of the next request is already buffered
        self._check_headers_done()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _check_headers_done(self) -> None:
        if self._header_timer is not None and not self._between_requests():
            self._cancel_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def h11_protocol_with_header_timeout(header_timeout: float,
                                     max_connections: int | None = None) -> type[HeaderTimeoutH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` (uvicorn builds it with fixed arguments)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
