"""The server's preparation lanes (server/preparation.py): a small request never waits behind large ones,
large work is admitted up to a bound (then 429), a grammar compile is limited in time (400) and in its
wait for a worker (429)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import httpx
import pytest

from engine.types import StructuredOutput
from server.preparation import SMALL_BODY_BYTES, Lane, Preparation, PreparationTimeout, lower_priority
from tests.api.test_api_app import CHAT, PROMPT, assert_openai_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.polling import async_wait_until, wait_until


def test_lane_admits_workers_plus_waiting_then_429() -> None:
    async def main() -> None:
        lane = Lane("test", workers=1, max_waiting=1)
        release = threading.Event()
        first = asyncio.create_task(lane.run(release.wait, 10))
        second = asyncio.create_task(lane.run(lambda: "second"))
        await asyncio.sleep(0.05)
        with pytest.raises(Exception) as info:
            await lane.run(lambda: "third")
        assert info.value.status == 429 and info.value.code == "server_busy"
        assert info.value.headers["Retry-After"]
        release.set()
        assert await first is True and await second == "second"
        assert lane.num_admitted == 0
        assert await lane.run(lambda: "again") == "again"
        lane.shutdown()

    asyncio.run(main())


def test_time_limit_counts_from_the_start_and_the_job_keeps_its_worker() -> None:
    """Events decide, not sleeps: a job queued behind a blocker runs once its worker frees (its wait, well
    within the limit, is limited apart from its run); a job that outlives its limit keeps its worker until
    it really ends."""
    async def main() -> None:
        lane = Lane("test", workers=1, max_waiting=4)
        blocker, overrun = threading.Event(), threading.Event()
        running = asyncio.create_task(lane.run(blocker.wait, 60))
        queued = asyncio.create_task(lane.run(lambda: "queued", time_limit=30.0))
        await async_wait_until(lambda: lane.num_admitted == 2, "both jobs admitted")
        await asyncio.sleep(0.2)
        assert not queued.done()
        blocker.set()
        await running
        assert await queued == "queued"
        with pytest.raises(PreparationTimeout):
            await lane.run(overrun.wait, 60, time_limit=0.2)
        assert lane.num_admitted == 1  # the timed-out job still holds its worker (it waits for `overrun`)
        overrun.set()
        await async_wait_until(lambda: lane.num_admitted == 0, "the overrun job's release")
        lane.shutdown()

    asyncio.run(main())


def test_a_job_that_cannot_start_within_the_limit_is_dropped_with_429() -> None:
    async def main() -> None:
        lane = Lane("test", workers=1, max_waiting=4)
        ran: list[str] = []
        blocker = threading.Event()
        busy = asyncio.create_task(lane.run(blocker.wait, 10))
        await asyncio.sleep(0.05)
        with pytest.raises(Exception) as info:
            await lane.run(ran.append, "late", time_limit=0.2)
        assert info.value.status == 429
        blocker.set()
        await busy
        await asyncio.sleep(0.1)
        assert ran == [] and lane.num_admitted == 0
        lane.shutdown()

    asyncio.run(main())


LINUX = sys.platform == "linux"  # where threads have nice values of their own (elsewhere lower_priority does nothing)


def thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def raised_nice(base: int, by: int) -> int:
    if base + by > 19:
        pytest.skip(f"this process already runs at nice {base}: a thread cannot go {by} lower")
    return base + by


def test_lanes_by_size_and_worker_threads_are_daemons_at_lower_priority() -> None:
    """Large, grammar and render lanes' workers at nice +10 (as the README says), the small lane's at the
    process's own: the exact values, so removing the nice (or giving it to the small lane) fails here (Linux)."""
    prep = Preparation(grammar_timeout=1.0)
    assert prep.lane(SMALL_BODY_BYTES) is prep.small and prep.lane(SMALL_BODY_BYTES + 1) is prep.large
    base = thread_nice()

    async def main() -> dict[str, tuple[bool, int]]:
        def probe() -> tuple[bool, int]:
            return threading.current_thread().daemon, thread_nice()

        lanes = ("small", "large", "small_grammar", "large_grammar", "render")
        return {name: await getattr(prep, name).run(probe) for name in lanes}

    seen = asyncio.run(main())
    prep.shutdown()
    lower = raised_nice(base, 10) if LINUX else base
    assert seen == {"small": (True, base), "large": (True, lower), "small_grammar": (True, lower),
                    "large_grammar": (True, lower), "render": (True, lower)}


def test_lower_priority_changes_only_the_calling_thread() -> None:
    before = thread_nice()
    seen: list[int] = []

    def worker() -> None:
        lower_priority(5)
        seen.append(thread_nice())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert thread_nice() == before
    assert seen == [raised_nice(before, 5) if LINUX else before]


def test_a_small_request_does_not_wait_behind_six_large_ones(fake_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six large requests whose tokenization blocks until released: once five are admitted to the large
    lane and the sixth refused (a state waited for, not a time), a small request is answered while the
    five are still blocked; then they finish."""
    engine = FakeEngine(max_context=10**7)
    srv = fake_server(engine, max_queue=16)
    real_encode = srv.state.prompt.encode  # the prompt's tokenizing (server/prompt.py)
    release = threading.Event()

    def encode(text: str, *args: object) -> list[int]:  # large prompts tokenize until released
        if len(text) > SMALL_BODY_BYTES:
            assert release.wait(120)
        return real_encode(text[:100], *args)

    monkeypatch.setattr(srv.state.prompt, "encode", encode)
    big = {**PROMPT, "prompt": "word " * (SMALL_BODY_BYTES // 4), "max_tokens": 3}
    answers: list[int] = []
    workers = [threading.Thread(target=lambda: answers.append(
        httpx.post(srv.url + "/v1/completions", json=big, timeout=180).status_code)) for _ in range(6)]
    for worker in workers:
        worker.start()
    large = srv.state.preparation.large
    wait_until(lambda: large.num_admitted == 5 and answers == [429], "five large requests admitted, one refused")
    small = httpx.post(srv.url + "/v1/completions", json={**PROMPT, "max_tokens": 3}, timeout=60)
    assert small.status_code == 200 and not release.is_set() and large.num_admitted == 5
    release.set()
    for worker in workers:
        worker.join(180)
    assert sorted(answers) == [200] * 5 + [429]  # one worker and four waiting; the sixth is refused at once


def test_a_grammar_that_compiles_too_long_is_400_naming_the_field(fake_server,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    srv = fake_server(engine, grammar_timeout=0.3)
    real = engine.validate_structured_output

    def slow(spec: StructuredOutput) -> None:
        if "slow" in spec.spec:
            time.sleep(1.0)
        real(spec)

    monkeypatch.setattr(engine, "validate_structured_output", slow)
    schema = {"type": "object", "properties": {"slow": {"type": "integer"}}}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    error = assert_openai_error(httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30), 400)
    assert error["param"] == "response_format" and error["code"] == "grammar_too_complex"
    assert "0.3 seconds" in error["message"]
    fast = {**body, "response_format": {"type": "json_object"}}
    assert httpx.post(srv.url + "/v1/chat/completions", json=fast, timeout=30).status_code == 200
