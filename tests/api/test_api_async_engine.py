"""AsyncEngine (engine/async_engine.py) over a FakeEngine: FIFO, bounded queue, abort within one step,
fault isolation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.types import (
    EngineFault,
    EngineUnavailable,
    FinishReason,
    QueueFull,
    TokenDelta,
)
from tests.helpers.fake_engine import FakeEngine, collect, make_async_engine, request
from tests.helpers.polling import async_wait_until


def test_submit_streams_deltas_and_keeps_the_event_loop_responsive() -> None:
    """Every engine step waits for a task on the event loop: were steps run on the event loop's
    thread, that task could not run and each wait would time out."""
    gate = threading.Event()
    released: list[bool] = []

    def wait_for_the_event_loop() -> None:
        released.append(gate.wait(timeout=10))
        gate.clear()

    async def main() -> None:
        engine = FakeEngine(before_step=wait_for_the_event_loop)
        async_engine, reports = make_async_engine(engine)

        async def opener() -> None:
            while True:
                gate.set()
                await asyncio.sleep(0.005)

        task = asyncio.create_task(opener())
        deltas = await collect(async_engine.submit(request("a", max_tokens=12)))
        task.cancel()
        assert [len(d.token_ids) for d in deltas] == [3, 3, 3, 3]
        assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].totals is not None
        assert released == [True] * 4
        await async_wait_until(lambda: len(reports) == 1)
        assert reports[0].num_steps == 4 and not reports[0].aborted
        async_engine.stop()

    asyncio.run(main())


def test_fifo_order_and_queue_bound() -> None:
    async def main() -> None:
        engine = FakeEngine(step_seconds=0.02)
        async_engine, _ = make_async_engine(engine, max_queue=1)
        first = async_engine.submit(request("first"))
        second = async_engine.submit(request("second"))  # waits: 1 running + 1 waiting
        with pytest.raises(QueueFull) as info:
            async_engine.submit(request("third"))
        assert info.value.retry_after >= 1
        assert async_engine.queue_depth + async_engine.num_running == 2
        await asyncio.gather(collect(first), collect(second))
        assert [r.request_id for r in engine.requests] == ["first", "second"]
        assert async_engine.queue_depth == 0 and async_engine.num_running == 0
        async_engine.stop()

    asyncio.run(main())


def test_a_finished_request_is_no_longer_running_when_its_last_delta_arrives() -> None:
    """The worker still has bookkeeping to do after the last delta (here a slow on_delta hook);
    the client that already has its answer must not see its request counted as running."""

    def slow_hook(delta: TokenDelta) -> None:
        if delta.finish_reason is not None:
            time.sleep(0.3)

    async def main() -> None:
        engine = FakeEngine()
        async_engine = AsyncEngine(engine, 4, on_delta=slow_hook)
        async_engine.start()
        for rid in ("a", "b"):
            deltas = await collect(async_engine.submit(request(rid, max_tokens=3)))
            assert deltas[-1].finish_reason == FinishReason.LENGTH
            assert async_engine.num_running == 0 and async_engine.queue_depth == 0
        async_engine.stop()

    asyncio.run(main())


def test_abort_running_request_within_one_step_and_waiting_at_once() -> None:
    async def main() -> None:
        engine = FakeEngine(step_seconds=0.05)
        async_engine, reports = make_async_engine(engine)
        running = async_engine.submit(request("run", max_tokens=300))
        waiting = async_engine.submit(request("wait"))
        first = await running.__anext__()
        assert first.token_ids
        assert async_engine.abort("wait") and async_engine.abort("run")
        rest = await collect(running)
        assert rest[-1].finish_reason == FinishReason.ABORT
        assert (await collect(waiting))[-1].finish_reason == FinishReason.ABORT
        await async_wait_until(lambda: len(reports) == 2)
        by_id = {r.request_id: r for r in reports}
        assert by_id["run"].aborted and by_id["run"].abort_lag_steps is not None
        assert by_id["run"].abort_lag_steps <= 1
        assert by_id["wait"].abort_lag_steps == 0
        assert not async_engine.abort("run")  # already gone
        deltas = await collect(async_engine.submit(request("next")))  # the AsyncEngine goes on
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        async_engine.stop()

    asyncio.run(main())


def test_aclose_aborts() -> None:
    async def main() -> None:
        engine = FakeEngine(step_seconds=0.02)
        async_engine, reports = make_async_engine(engine)
        stream = async_engine.submit(request("r", max_tokens=300))
        await stream.__anext__()
        await stream.aclose()
        await async_wait_until(lambda: len(reports) == 1)
        assert reports[0].aborted and async_engine.num_running == 0
        async_engine.stop()

    asyncio.run(main())


def test_request_failure_is_isolated_and_fault_takes_engine_down() -> None:
    async def main() -> None:
        engine = FakeEngine(fail_with=ValueError("boom"))
        async_engine, _ = make_async_engine(engine)
        with pytest.raises(ValueError, match="boom"):
            await collect(async_engine.submit(request("bad")))
        engine.fail_with = None
        assert (await collect(async_engine.submit(request("good"))))[-1].finish_reason == FinishReason.LENGTH
        assert async_engine.healthy
        engine.fail_with = EngineFault("device lost")
        with pytest.raises(EngineFault):
            await collect(async_engine.submit(request("fault")))
        await async_wait_until(lambda: not async_engine.healthy)
        with pytest.raises(EngineUnavailable):
            async_engine.submit(request("after"))
        async_engine.stop()

    asyncio.run(main())
