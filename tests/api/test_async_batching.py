"""AsyncEngine with an engine that runs several requests per step: they progress together, a request
joins between steps and gets its first delta from the next step, one aborted request leaves the
others running, and the queue bound counts only what cannot start now."""

from __future__ import annotations

import asyncio

import pytest

from engine.types import FinishReason, QueueFull
from tests.helpers.fake_engine import FakeEngine, collect, make_async_engine, request
from tests.helpers.polling import async_wait_until


def test_running_requests_share_every_step() -> None:
    async def main() -> None:
        engine = FakeEngine(max_running=3, step_seconds=0.01, max_context=100_000)
        async_engine, reports = make_async_engine(engine)
        streams = [async_engine.submit(request(f"r{i}", 30)) for i in range(3)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        async_engine.stop()
        for deltas in results:
            assert sum(len(d.token_ids) for d in deltas) == 30 and deltas[-1].finish_reason == FinishReason.LENGTH
        assert engine.steps_run == 30  # 10 steps each; three per engine step would be 10 engine steps
        assert {r.num_steps for r in reports} == {10}

    asyncio.run(main())


def test_a_short_request_joining_a_long_one_starts_at_the_next_step() -> None:
    async def main() -> None:
        engine = FakeEngine(max_running=2, step_seconds=0.02, max_context=100_000)
        async_engine, _ = make_async_engine(engine)
        long = async_engine.submit(request("long", 3000))
        first = await long.__anext__()
        assert first.token_ids
        steps_before = len(engine.step_log)
        short = async_engine.submit(request("short", 6))
        deltas = await collect(short)
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        await long.aclose()
        async_engine.stop()
        # counted in engine steps, not seconds: the short request's 2 steps (3 tokens each) were the two
        # after the step in flight when it was submitted (+1 should the worker pass a step boundary
        # between those two lines), back to back, each beside the long request
        short_steps = [i for i, ids in enumerate(engine.step_log) if "short" in ids]
        assert len(short_steps) == 2 and short_steps[1] == short_steps[0] + 1, engine.step_log
        assert short_steps[0] <= steps_before + 2, (steps_before, short_steps)
        assert all(engine.step_log[i] == ["long", "short"] for i in short_steps)

    asyncio.run(main())


def test_abort_in_a_batch_leaves_the_others_running() -> None:
    async def main() -> None:
        engine = FakeEngine(max_running=3, step_seconds=0.01, max_context=100_000)
        async_engine, reports = make_async_engine(engine)
        keep = [async_engine.submit(request(f"k{i}", 24)) for i in range(2)]
        drop = async_engine.submit(request("drop", 3000))
        await drop.__anext__()
        assert async_engine.abort("drop")
        dropped = await collect(drop)
        kept = await asyncio.gather(*(collect(s) for s in keep))
        async_engine.stop()
        assert dropped[-1].finish_reason == FinishReason.ABORT
        assert all(d[-1].finish_reason == FinishReason.LENGTH for d in kept)
        report = next(r for r in reports if r.request_id == "drop")
        assert report.aborted and report.abort_lag_steps is not None and report.abort_lag_steps <= 1

    asyncio.run(main())


def test_the_queue_bound_counts_what_cannot_start() -> None:
    async def main() -> None:
        engine = FakeEngine(max_running=2, step_seconds=0.05, max_context=100_000)
        async_engine, _ = make_async_engine(engine, max_queue=1)
        streams = [async_engine.submit(request(f"r{i}", 3000)) for i in range(3)]  # 2 run, 1 waits
        await async_wait_until(lambda: (async_engine.num_running, async_engine.queue_depth) == (2, 1),
                               "two running, one waiting")
        with pytest.raises(QueueFull):
            async_engine.submit(request("over", 3))
        for stream in streams:
            await stream.aclose()
        async_engine.stop()

    asyncio.run(main())


def test_drain_ends_every_running_request() -> None:
    async def main() -> None:
        engine = FakeEngine(max_running=3, step_seconds=0.02, max_context=100_000)
        async_engine, reports = make_async_engine(engine)
        streams = [async_engine.submit(request(f"r{i}", 3000)) for i in range(4)]  # 3 run, 1 waits
        for stream in streams[:3]:
            await stream.__anext__()
        assert await async_engine.drain(0.0) == 4
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert all(deltas[-1].finish_reason == FinishReason.ABORT for deltas in results)
        async_engine.stop()
        assert async_engine.num_running == 0 and async_engine.queue_depth == 0

    asyncio.run(main())
