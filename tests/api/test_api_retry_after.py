"""Retry-After covers the queued work (never the old 1 s-per-request guess), and HEAD /health."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from engine.async_engine import MAX_RETRY_AFTER, AsyncEngine
from engine.types import QueueFull, Request, SamplingParams
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.polling import async_wait_until

STEP = 5.0  # seconds of the fake clock per engine step
STEPS = 4  # engine steps per request (3 tokens each): every request takes 20 s of fake time


class FakeClock:
    """Time that moves only when the engine steps: durations are exact, the test never sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.gate = threading.Semaphore(0)  # the test releases one step at a time

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:  # FakeEngine.before_step, in the worker thread
        assert self.gate.acquire(timeout=30)
        self.now += STEP


def request(request_id: str) -> Request:
    return Request(request_id, [1, 2], SamplingParams(temperature=0, max_tokens=3 * STEPS, ignore_eos=True))


def test_retry_after_covers_the_queued_work() -> None:
    clock = FakeClock()
    engine = FakeEngine(before_step=clock.step, max_context=10_000)

    async def rejected_retry_after(async_engine: AsyncEngine) -> int:
        with pytest.raises(QueueFull) as info:
            async_engine.submit(request("over"))
        return info.value.retry_after

    async def main() -> None:
        async_engine = AsyncEngine(engine, max_queue=1, clock=clock)
        async_engine.start()
        first = [async_engine.submit(request("a")), async_engine.submit(request("b"))]  # running + waiting
        await async_wait_until(lambda: engine.steps_run > 0 or async_engine.num_running > 0, "a running request")
        # no request has finished yet: the real wait is a's 20 s + b's 20 s of fake time
        assert await rejected_retry_after(async_engine) >= 2 * STEPS * STEP
        clock.gate.release(2 * STEPS)  # a and b run to the end: the mean request time is now 20 s
        for stream in first:
            assert [d async for d in stream][-1].finish_reason is not None
        second = [async_engine.submit(request("c")), async_engine.submit(request("d"))]
        clock.gate.release(1)  # c has run one step (5 s): 15 s left, then d's 20 s
        await async_wait_until(lambda: clock.now >= (2 * STEPS + 1) * STEP, "c's first step")
        remaining = (STEPS - 1) * STEP + STEPS * STEP
        assert remaining <= await rejected_retry_after(async_engine) <= MAX_RETRY_AFTER
        clock.gate.release(2 * STEPS)
        for stream in second:
            assert [d async for d in stream][-1].finish_reason is not None
        async_engine.stop()

    asyncio.run(main())


def test_head_health(fake_server) -> None:
    srv = fake_server()
    response = httpx.head(srv.url + "/health")
    assert response.status_code == 200 and response.content == b""
    release = threading.Event()

    def slow_loader(config):
        assert release.wait(30)
        return FakeEngine()

    loading = fake_server(loader=slow_loader)
    assert httpx.head(loading.url + "/health").status_code == 503
    release.set()
