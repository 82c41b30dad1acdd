"""Graceful shutdown: SIGTERM/SIGINT drain the server (new requests 503, running ones get a grace
period, the rest end with an error event + [DONE] or a 503), exit 0, no traceback.

In-process tests drive `DrainingServer.handle_exit` over a FakeEngine; the live tests send real
signals to `specexec serve`."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from tests.api.conftest import free_port, run_uvicorn
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.polling import async_wait_until
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
