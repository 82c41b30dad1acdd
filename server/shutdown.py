"""Graceful shutdown: SIGTERM or SIGINT drains the server instead of cutting it off.

On the first signal the server keeps listening but answers new requests with an OpenAI-shaped
503 (`server_shutting_down`; /health: 503 `shutting_down`), and the requests already in flight
get up to `shutdown_timeout` seconds to finish. Then whatever still runs or waits in the engine
is aborted: a stream ends with one `data: {"error": ...}` event and `data: [DONE]`, a
non-streamed request gets the 503, and so does a request whose body is still arriving. Only then does uvicorn close the listener and exit; the
process exits 0 and prints no traceback. A second SIGINT (Ctrl+C) ends the grace period at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.server import HANDLED_SIGNALS

from server.errors import APIError, shutting_down
from server.state import ServerState

log = logging.getLogger("specexec.server")

FLUSH_SECONDS = 5.0  # after the aborts: time for the cut-off responses to reach their clients
POLL_SECONDS = 0.05
OPEN_WHILE_DRAINING = frozenset({"/health", "/metrics"})


class DrainGate:
    """Pure ASGI: counts the HTTP requests in flight; while draining, refuses new ones with 503."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            response = shutting_down().response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive_until_cut_off(receive, self.state.cut_off), send)
        finally:
            self.state.in_flight -= 1


def receive_until_cut_off(receive: Receive, cut_off: asyncio.Event) -> Receive:
    """`receive`, except that while the request body is still arriving, `cut_off` being set ends the
    wait with a 503 (APIError, answered by the app's error handler, connection closed)."""
    body_done = False

    async def receive_body() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        if cut_off.is_set():
            raise _cut_off_error()
        message = asyncio.ensure_future(receive())
        cutting = asyncio.ensure_future(cut_off.wait())
        try:
            await asyncio.wait({message, cutting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cutting.cancel()
            if not message.done():
                message.cancel()
        if not message.done() or message.cancelled():
            raise _cut_off_error()
        result = message.result()
        body_done = result["type"] != "http.request" or not result.get("more_body", False)
        return result

    return receive_body


def _cut_off_error() -> APIError:
    error = shutting_down()
    error.headers["connection"] = "close"
    return error


async def drain(state: ServerState, grace: float, hurry: Callable[[], bool] = lambda: False) -> int:
    """Refuse new requests, give those in flight `grace` seconds (less if `hurry()` turns true),
    abort what the engine still holds, and wait for the cut-off responses to go out.
    Returns how many engine requests were aborted."""
    state.draining = True
    log.info("shutting down: %d request(s) in flight get up to %gs to finish", state.in_flight, grace)
    deadline = time.monotonic() + grace
    while state.in_flight and time.monotonic() < deadline and not hurry():
        await asyncio.sleep(POLL_SECONDS)
    state.cut_off.set()  # bodies still arriving: 503
    aborted = 0
    if state.async_engine is not None:
        aborted = await state.async_engine.drain(0.0)
    if aborted:
        log.warning("shutting down: aborted %d unfinished request(s)", aborted)
    deadline = time.monotonic() + FLUSH_SECONDS
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
    return aborted


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT run `drain` before uvicorn's own shutdown, and which
    does not re-raise the signal afterwards (so: exit status 0, no KeyboardInterrupt traceback)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.signalled = False
        self.first_signal: int | None = None  # the signal that began the shutdown
        self.hurry = False
        self._drain_task: asyncio.Task[int] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: only sets flags; `on_tick` (every 0.1 s on the loop) acts on them."""
        if self.signalled:
            self.hurry = True  # a second signal: end the grace period now
        else:
            self.first_signal = sig
        self.signalled = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):  # should_exit (the engine failed to load)
            return True
        if not self.signalled:
            return False
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(drain(self.state, self.shutdown_timeout, lambda: self.hurry))
        if not self._drain_task.done():
            return False
        self._drain_task.result()  # re-raise a bug in drain rather than hide it
        self.should_exit = True
        return True
