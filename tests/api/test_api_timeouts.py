"""Read timeouts: a connection that sends partial request headers is closed (slowloris)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from engine.config import EngineConfig, LimitsConfig
from server.app import build_app
from server.config import ServerConfig
from server.http_protocol import h11_protocol_with_header_timeout
from tests.api.conftest import free_port, run_uvicorn
from tests.helpers.fake_engine import FakeEngine

PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"


def closed_after(port: int, first: bytes, limit: float, trickle: bool = False) -> float:
    """Send `first` (then, if `trickle`, one more header byte a second), and return the seconds until the
    server closes the connection; fails if it is still open after `limit` seconds."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as sock:
        sock.sendall(first)
        sock.settimeout(1.0)
        while time.monotonic() - started < limit:
            try:
                if sock.recv(4096) == b"":
                    return time.monotonic() - started
            except TimeoutError:
                if trickle:
                    try:
                        sock.sendall(b"X")
                    except OSError:
                        return time.monotonic() - started
            except ConnectionResetError:
                return time.monotonic() - started
    pytest.fail(f"the connection was still open after {limit}s")


@pytest.fixture
def timed_server() -> Iterator[int]:
    port = free_port()
    app = build_app(EngineConfig(limits=LimitsConfig(max_queue=4)), ServerConfig(port=port), FakeEngine())
    server, thread = run_uvicorn(app, port, http=h11_protocol_with_header_timeout(1.0))
    yield port
    server.should_exit = True
    thread.join(15)


def test_partial_headers_are_cut_off(timed_server: int) -> None:
    closed_after(timed_server, PARTIAL, limit=15)
    closed_after(timed_server, b"", limit=15)  # a connection that sends nothing at all
    closed_after(timed_server, PARTIAL, limit=15, trickle=True)  # bytes keep coming, the headers never end


def test_kept_alive_connections_and_slow_requests_still_work(timed_server: int) -> None:
    url = f"http://127.0.0.1:{timed_server}"
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(3):  # one connection, several requests, each well within the header deadline
            assert http.get("/health").status_code == 200
            time.sleep(0.3)
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 5}
        assert http.post("/v1/completions", json=body).status_code == 200
    # a kept-alive connection whose next request stops half-way through its headers is cut off too
    with socket.create_connection(("127.0.0.1", timed_server), timeout=15) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b""
        while b'{"status":"ok"}' not in reply:
            reply += sock.recv(4096)
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        sock.settimeout(15)
        started = time.monotonic()
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 14


@pytest.mark.slow
def test_live_server_closes_partial_header_connections(live_server) -> None:
    port = int(live_server.url.rsplit(":", 1)[1])
    waited = closed_after(port, PARTIAL, limit=40)  # the default --read-timeout is 10 s
    assert waited >= 5  # not cut off at once: the client had its read timeout
    assert httpx.get(f"{live_server.url}/health").status_code == 200
