"""A cap on open connections, below the process's file limit, so a flood of connections cannot starve
the server of file descriptors.

Without one, 1,100 slow-body connections at a file limit of 1,024 left nothing for new sockets or files:
/health was unreachable, asyncio logged tens of MB of accept errors, and a fresh server answered 1,015
requests with 500. Here (server/http_protocol.py, per connection as it opens):

- up to `limit` connections are served as usual;
- the next BUSY_CONNECTIONS get an OpenAI-shaped 503 (`too_many_connections`, Retry-After, the
  connection closed), except the probes of OPEN_WHEN_BUSY (/health, /metrics, /), still answered;
- beyond those, a connection is closed at once, unread.

`limit` is `--max-connections`, at most the soft file limit less RESERVED_FILES and BUSY_CONNECTIONS.
The reserve holds the files of the process (model files, logs, the device's) and one burst of accepts:
asyncio accepts up to the listen backlog at once before any connection is looked at, so `specexec
serve` listens with a backlog of ACCEPT_BACKLOG (waiting connections beyond it stay in the kernel's
queue, holding no file). It also first raises the soft file limit to the hard one (as Go's runtime
does), up to MAX_FILE_LIMIT. Refusals are logged at most once per LOG_INTERVAL seconds, with their
count; so are asyncio's accept errors, should the file limit be reached anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError

log = logging.getLogger("specexec.server")

RESERVED_FILES = 192  # file descriptors kept for everything but client connections, a burst of accepts included
ACCEPT_BACKLOG = 64  # the listen backlog: connections accepted in one burst, at most
BUSY_CONNECTIONS = 32  # connections past the limit that still get a 503 answer
MAX_FILE_LIMIT = 65536
MIN_LIMIT = 8
OPEN_WHEN_BUSY = frozenset({"/health", "/metrics", "/"})
LOG_INTERVAL = 10.0  # seconds
DRAIN_SECONDS = 0.5  # a refused request's body is read this long at most (a close with unread data resets)
RETRY_SECONDS = 1


def raise_file_limit(maximum: int = MAX_FILE_LIMIT) -> int:
    """Raise the soft limit on open files to the hard one (at most `maximum`); the soft limit now."""
    try:
        import resource
    except ImportError:  # not POSIX
        return maximum
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = maximum if hard == resource.RLIM_INFINITY else min(hard, maximum)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return maximum if soft == resource.RLIM_INFINITY else soft


def connection_limit(max_connections: int, file_limit: int) -> int:
    """The connections served at once: `max_connections`, at most what the file limit leaves."""
    return max(MIN_LIMIT, min(max_connections, file_limit - RESERVED_FILES - BUSY_CONNECTIONS))


class RateLimitedLog:
    """A warning at most once per `interval` seconds, with how many events it stands for."""

    def __init__(self, message: str, interval: float = LOG_INTERVAL):
        self.message = message
        self.interval = interval
        self.num_events = 0  # since the last warning
        self._last: float | None = None

    def event(self, *args: object) -> None:
        self.num_events += 1
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval:
            return
        log.warning(self.message + " (%d since the last such message)", *args, self.num_events)
        self.num_events, self._last = 0, now


class AcceptErrorFilter(logging.Filter):
    """Lets through one of asyncio's "socket.accept() out of system resource" errors per interval."""

    def __init__(self, interval: float = LOG_INTERVAL):
        super().__init__()
        self.interval = interval
        self.num_dropped = 0
        self._last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if "out of system resource" not in str(record.msg):
            return True
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval:
            self.num_dropped += 1
            return False
        self._last = now
        if self.num_dropped:
            record.msg = f"{record.msg} ({self.num_dropped} more since the last such message)"
            self.num_dropped = 0
        return True


def install_accept_error_filter() -> None:
    logging.getLogger("asyncio").addFilter(AcceptErrorFilter())


def too_many_connections(limit: int) -> APIError:
    error = APIError(503, f"The server has too many open connections (--max-connections {limit}). Retry later.",
                     type="service_unavailable_error", code="too_many_connections",
                     headers={"Retry-After": str(RETRY_SECONDS), "connection": "close"}, retry=True)
    return error


def busy_app(app: ASGIApp, limit: int) -> ASGIApp:
    """`app` for a connection past the limit: the probes of OPEN_WHEN_BUSY as usual, anything else a 503
    (its body read briefly first, so the close does not reset the connection before the answer)."""

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_WHEN_BUSY:
            await app(scope, receive, send)
            return
        try:
            await asyncio.wait_for(_drain(receive), DRAIN_SECONDS)
        except TimeoutError:
            pass
        await too_many_connections(limit).response()(scope, receive, send)

    return refuse


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
