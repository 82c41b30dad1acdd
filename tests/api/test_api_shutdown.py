"""Graceful shutdown: SIGTERM/SIGINT drain the server (new requests 503, running ones get a grace
period, the rest end with an error event + [DONE] or a 503), exit 0, no traceback.

In-process tests drive `DrainingServer.handle_exit` over a FakeEngine; the live tests send real
signals to `specexec serve`."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, LimitsConfig
from engine.types import EngineUnavailable, FinishReason, Request, SamplingParams
from server.app import build_app
from server.config import ServerConfig
from server.http_protocol import h11_protocol_with_header_timeout
from server.shutdown import DrainingServer
from tests.api.conftest import REPO, STARTUP_TIMEOUT, free_port, run_uvicorn, serve_command
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.polling import async_wait_until, wait_until
from tests.helpers.sse_helpers import parse_sse

MSGS = [{"role": "user", "content": "hi"}]


@dataclass
class Drainable:
    url: str
    engine: FakeEngine
    server: DrainingServer
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.server.state


@pytest.fixture
def drainable() -> Iterator[Callable[..., Drainable]]:
    running: list[Drainable] = []

    def start(engine: FakeEngine, shutdown_timeout: float) -> Drainable:
        port = free_port()
        engine_config = EngineConfig(limits=LimitsConfig(max_queue=4, default_max_tokens=64))
        app = build_app(engine_config, ServerConfig(port=port, shutdown_timeout=shutdown_timeout), engine)
        server, thread = run_uvicorn(
            app, port, lambda config: DrainingServer(config, app.state.specexec, shutdown_timeout),
            http=h11_protocol_with_header_timeout(10),
        )
        drainable = Drainable(f"http://127.0.0.1:{port}", engine, server, thread)
        running.append(drainable)
        return drainable

    yield start
    for each in running:
        each.server.should_exit = True
        each.thread.join(timeout=15)


async def read_stream(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                      first: asyncio.Event | None = None) -> list[str]:
    """The `data:` payloads of one stream, read to its end."""
    text = ""
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for piece in response.aiter_text():
            text += piece
            if first is not None and "data: " in text:
                first.set()
    return parse_sse(text)[0]


def error_then_done(data: list[str]) -> dict:
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    error = json.loads(data[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_drain_lets_running_requests_finish_then_ends_the_rest(drainable) -> None:
    """The running request is held in its second step until the server drains (so it is surely still
    running then), and finishes in 0.15 s once let go: far inside the 5 s grace period."""
    steps = threading.Semaphore(1)

    def held() -> None:  # FakeEngine.before_step, in the worker thread
        assert steps.acquire(timeout=60)

    srv = drainable(FakeEngine(step_seconds=0.01, max_context=100_000, before_step=held), shutdown_timeout=5.0)
    short = {"model": "fake-model", "messages": MSGS, "max_tokens": 45}  # 15 steps
    endless = {**short, "max_tokens": 50_000, "ignore_eos": True}

    async def main() -> tuple[list[str], list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            first = asyncio.Event()
            running = asyncio.create_task(read_stream(http, "/v1/chat/completions", short, first))
            await asyncio.wait_for(first.wait(), 30)
            cut = asyncio.create_task(read_stream(http, "/v1/chat/completions", endless))
            queued = asyncio.create_task(http.post("/v1/chat/completions", json=endless))
            await async_wait_until(lambda: srv.state.async_engine.queue_depth == 2, "two waiting")
            srv.server.handle_exit(signal.SIGTERM, None)
            await async_wait_until(lambda: srv.state.draining, "draining")
            refused = await http.post("/v1/chat/completions", json=short)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            health = await http.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "shutting_down"}
            steps.release(1_000_000)  # every later step runs at once
            return await running, await cut, await queued

    finished, cut, queued = asyncio.run(main())
    assert finished[-1] == "[DONE]" and json.loads(finished[-2])["choices"][0]["finish_reason"] == "length"
    assert error_then_done(cut)["code"] == "server_shutting_down"
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "server_shutting_down"
    assert set(queued.json()["error"]) == {"message", "type", "param", "code"}
    srv.thread.join(30)
    assert not srv.thread.is_alive()  # the server exited after the drain


def test_second_signal_ends_the_grace_period(drainable) -> None:
    srv = drainable(FakeEngine(step_seconds=0.1, max_context=100_000), shutdown_timeout=600.0)
    endless = {"model": "fake-model", "prompt": "hi", "max_tokens": 50_000, "ignore_eos": True}

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            first = asyncio.Event()
            stream = asyncio.create_task(read_stream(http, "/v1/completions", endless, first))
            await asyncio.wait_for(first.wait(), 30)
            srv.server.handle_exit(signal.SIGINT, None)
            await async_wait_until(lambda: srv.state.draining, "draining")
            srv.server.handle_exit(signal.SIGINT, None)
            return await asyncio.wait_for(stream, 30)  # far less than the 600 s grace

    assert error_then_done(asyncio.run(main()))["code"] == "server_shutting_down"
    srv.thread.join(30)
    assert not srv.thread.is_alive()


def test_a_body_still_arriving_when_the_grace_period_ends_gets_503(drainable,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    srv = drainable(FakeEngine(), shutdown_timeout=0.5)
    port = int(srv.url.rsplit(":", 1)[1])
    with caplog.at_level(logging.ERROR), socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000)
        wait_until(lambda: srv.server.server_state.tasks, "the request's task started")  # reading the body
        srv.server.handle_exit(signal.SIGTERM, None)
        reply = b""
        while b'"}}' not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
    assert b"server_shutting_down" in reply and b"connection: close" in reply.lower()
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_async_engine_drain() -> None:
    def request(request_id: str, max_tokens: int) -> Request:
        return Request(request_id, [1, 2], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    async def main() -> None:
        engine = AsyncEngine(FakeEngine(step_seconds=0.02, max_context=100_000), max_queue=4)
        engine.start()
        short = [engine.submit(request(f"s{i}", 6)) for i in range(2)]
        assert await engine.drain(30) == 0  # both finish within the timeout
        for stream in short:
            assert [d async for d in stream][-1].finish_reason == FinishReason.LENGTH
        with pytest.raises(EngineUnavailable, match="shutting down"):
            engine.submit(request("late", 3))
        engine.stop()

        engine = AsyncEngine(FakeEngine(step_seconds=0.02, max_context=100_000), max_queue=4)
        engine.start()
        long = [engine.submit(request(f"l{i}", 30_000)) for i in range(3)]
        assert await engine.drain(0.3) == 3  # one running, two waiting: all aborted
        for stream in long:
            assert [d async for d in stream][-1].finish_reason == FinishReason.ABORT
        engine.stop()  # the step in flight finishes in the worker
        assert engine.queue_depth == 0 and engine.num_running == 0

        # a step that does not end (a slow offloaded pass): the stream still ends at once
        in_step, step_may_end = threading.Event(), threading.Event()
        stuck = FakeEngine(before_step=lambda: (in_step.set(), step_may_end.wait(30)), max_context=100_000)
        engine = AsyncEngine(stuck, max_queue=4)
        engine.start()
        stream = engine.submit(request("stuck", 30))
        await asyncio.to_thread(in_step.wait, 30)
        assert await engine.drain(0) == 1
        assert [d async for d in stream][-1].finish_reason == FinishReason.ABORT
        assert engine.num_running == 1  # still in its step
        step_may_end.set()
        engine.stop()
        assert engine.num_running == 0

    asyncio.run(main())


# -- live server: real signals ------------------------------------------------------------


def live_drain(server, sig: signal.Signals) -> tuple[list[list[str]], httpx.Response]:
    """Three long streams and one queued non-streamed request, then `sig`: everything ends."""
    body = {"messages": MSGS, "max_tokens": 480, "temperature": 0, "ignore_eos": True}

    async def main() -> tuple[list[list[str]], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            first = asyncio.Event()
            streams = [asyncio.create_task(read_stream(http, "/v1/chat/completions", body, first))]
            await asyncio.wait_for(first.wait(), 60)
            streams += [asyncio.create_task(read_stream(http, "/v1/chat/completions", body)) for _ in range(2)]
            plain = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            await async_wait_until(lambda: "specexec_queue_depth 3.0" in httpx.get(f"{server.url}/metrics").text,
                                   "three waiting")
            server.process.send_signal(sig)
            return await asyncio.gather(*streams), await plain

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_live_signal_drains_streams_and_exits_cleanly(start_serve, sig: signal.Signals) -> None:
    server = start_serve("--budget", "8", "--shutdown-timeout", "0", "--max-running", "1")
    streams, plain = live_drain(server, sig)
    for data in streams:  # every stream ends properly; the running one may have just finished
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    for data in streams[1:]:  # the queued ones cannot have: error event, then [DONE]
        assert error_then_done(data)["code"] == "server_shutting_down"
    assert plain.status_code == 503, plain.text
    assert plain.json()["error"]["code"] == "server_shutting_down"
    assert server.process.wait(timeout=60) == 0
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert "shutting down: aborted" in log


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads signal handlers from /proc (Linux)")
@pytest.mark.parametrize("extra_wait", [0.0, 1.5])
def test_sigterm_before_the_server_listens_exits_0(tiny_pair, tmp_path, extra_wait: float) -> None:
    """SIGTERM once `serve` handles it (its handler is seen installed, not guessed from a delay: before
    that the signal's default action kills any process, 143), at once or while it still imports: exit 0.
    Either way before it listens on a busy machine; were it listening already, the drain exits 0 too."""
    target, draft = tiny_pair
    cmd = [*serve_command(), "--target", str(target), "--draft", str(draft), "--port", str(free_port())]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: process.poll() is not None or catches(process.pid, signal.SIGTERM),
                   "serve's SIGTERM handler installed", timeout=STARTUP_TIMEOUT)
        time.sleep(extra_wait)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        process.kill()
    assert "Traceback" not in log.read_text(errors="replace")


SLOW_LOAD = """
import sys, time
import torch
import engine.runtime as runtime

real_load = runtime.Engine.load.__func__


def slow_load(cls, config):  # a load that takes 10 minutes, busy in torch as a real one is
    print("specexec-test: load started", flush=True)
    deadline, x = time.monotonic() + 600, torch.rand(256, 256)
    while time.monotonic() < deadline:
        x = torch.nn.functional.normalize(x @ x)
    return real_load(cls, config)


runtime.Engine.load = classmethod(slow_load)
from specexec.__main__ import main

sys.exit(main(sys.argv[1:]))
"""


def health(port: int) -> dict | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("num_signals", [1, 2])
def test_ctrl_c_while_the_model_loads_stops_the_load_and_exits_130(tiny_pair, tmp_path, num_signals: int) -> None:
    """Ctrl+C once the server listens and its (10-minute) load runs in its thread: the process exits 130
    at once, not after the load; a second Ctrl+C right after never crashes it (it was: `terminate called
    without an active exception`, exit 134, after the whole load)."""
    target, draft = tiny_pair
    port = free_port()
    cmd = [sys.executable, "-c", SLOW_LOAD, "serve", "--target", str(target), "--draft", str(draft),
           "--port", str(port)]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_until(lambda: process.poll() is not None or "load started" in log.read_text(errors="replace"),
                   "the load started", timeout=STARTUP_TIMEOUT)
        wait_until(lambda: process.poll() is not None or health(port) == {"status": "loading"}, "listening, loading")
        for _ in range(num_signals):
            process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 130, log.read_text(errors="replace")[-3000:]  # 120 s << 600 s
    finally:
        process.kill()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "terminate called" not in text, text[-3000:]
    assert "stopped while the model was loading (SIGINT)" in text
