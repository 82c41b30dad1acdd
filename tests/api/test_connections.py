"""The cap on open connections (server/connections.py, server/http_protocol.py): past it a 503 in the
API's error shape (probes still answered), past that the connection is closed at once; the cap stays
below the file limit, so a flood of slow connections leaves /health reachable and no request a 500;
refusals and accept errors are logged at most once per interval."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig, LimitsConfig
from server.app import build_app
from server.config import ServerConfig
from server.connections import (
    BUSY_CONNECTIONS,
    RESERVED_FILES,
    AcceptErrorFilter,
    RateLimitedLog,
    connection_limit,
)
from server.http_protocol import h11_protocol_with_header_timeout
from tests.api.conftest import REPO, free_port, run_uvicorn
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.polling import wait_until

PROMPT = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{")


@pytest.fixture
def capped() -> Iterator[Any]:
    running = []

    def start(limit: int) -> tuple[str, Any]:
        port = free_port()
        config = ServerConfig(port=port, read_timeout=120)
        app = build_app(EngineConfig(limits=LimitsConfig(max_queue=4, default_max_tokens=8)), config, FakeEngine())
        server, thread = run_uvicorn(app, port, http=h11_protocol_with_header_timeout(120, limit))
        running.append((server, thread))
        return f"http://127.0.0.1:{port}", server

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=15)


def slow_connection(url: str, data: bytes = SLOW_BODY) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def test_past_the_cap_503_then_closed_at_once_and_probes_still_answer(capped) -> None:
    limit = 4
    url, server = capped(limit)
    held = [slow_connection(url) for _ in range(limit)]  # requests whose bodies never finish
    wait_until(lambda: len(server.server_state.connections) == limit, "the slow connections admitted")
    refused = httpx.post(url + "/v1/completions", json=PROMPT, timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    error = refused.json()["error"]
    assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable_error"
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}  # a probe past the cap
    assert httpx.head(url + "/", timeout=30).status_code == 200
    held += [slow_connection(url, b"") for _ in range(BUSY_CONNECTIONS)]  # the busy tier, silent
    wait_until(lambda: len(server.server_state.connections) == limit + BUSY_CONNECTIONS, "the busy tier full")
    beyond = slow_connection(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        assert beyond.recv(1024) == b""  # closed unread
    except ConnectionResetError:
        pass
    beyond.close()
    for sock in held:
        sock.close()
    wait_until(lambda: len(server.server_state.connections) == 0, "the connections closed")
    assert httpx.post(url + "/v1/completions", json=PROMPT, timeout=30).status_code == 200


def test_the_cap_stays_below_the_file_limit() -> None:
    assert connection_limit(1024, 65536) == 1024
    assert connection_limit(1024, 1024) == 1024 - RESERVED_FILES - BUSY_CONNECTIONS
    assert connection_limit(1000, 300) == 300 - RESERVED_FILES - BUSY_CONNECTIONS
    assert connection_limit(1024, 100) >= 1


def test_refusals_and_accept_errors_are_logged_at_most_once_per_interval(caplog) -> None:
    caplog.set_level(logging.WARNING, "specexec.server")
    refusals = RateLimitedLog("refusing: %d open", interval=3600)
    for n in range(1000):
        refusals.event(n)
    assert len(caplog.records) == 1 and refusals.num_events == 999
    accept_errors = AcceptErrorFilter(interval=3600)
    records = [logging.LogRecord("asyncio", logging.ERROR, "x", 1, "socket.accept() out of system resource", None,
                                 None) for _ in range(1000)]
    assert sum(accept_errors.filter(record) for record in records) == 1 and accept_errors.num_dropped == 999
    other = logging.LogRecord("asyncio", logging.ERROR, "x", 1, "something else", None, None)
    assert accept_errors.filter(other)


SERVER = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import logging, uvicorn
    from engine.config import EngineConfig, LimitsConfig
    from server.app import build_app
    from server.config import ServerConfig
    from server.connections import ACCEPT_BACKLOG, connection_limit, install_accept_error_filter
    from server.http_protocol import h11_protocol_with_header_timeout
    from tests.helpers.fake_engine import FakeEngine

    logging.basicConfig(level="INFO")
    install_accept_error_filter()
    port = int(sys.argv[1])
    limit = connection_limit(1024, 256)
    app = build_app(EngineConfig(limits=LimitsConfig(default_max_tokens=8)), ServerConfig(port=port, read_timeout=120),
                    FakeEngine())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", backlog=ACCEPT_BACKLOG,
                http=h11_protocol_with_header_timeout(120, limit))
""")


def test_a_flood_of_slow_connections_at_a_low_file_limit(tmp_path) -> None:
    """The attack's shape at a file limit of 256: 300 slow-body connections. /health stays reachable, no
    request is a 500, and the log stays short."""
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=log_file,
                                   stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        wait_until(lambda: _healthy(url), "the server up")
        for _ in range(300):
            try:
                held.append(slow_connection(url))
            except OSError:
                break
        assert len(held) == 300
        # connections past the busy tier were closed at once; those in it are answered within DRAIN_SECONDS
        wait_until(lambda: _healthy(url), "/health answered during the flood")
        statuses = [httpx.post(url + "/v1/completions", json=PROMPT, timeout=30).status_code for _ in range(20)]
        assert set(statuses) == {503}, statuses
        assert all(_healthy(url) for _ in range(5))
    finally:
        for sock in held:
            sock.close()
        process.terminate()
        process.wait(30)
    text = log_path.read_text(errors="replace")
    assert "Too many open files" not in text and "Traceback" not in text, text[-3000:]
    assert len(text) < 20_000, len(text)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False
