"""Asyncio engine loop: `submit()` -> async iterator of token deltas, `abort()`; one worker thread.

Scheduling: continuous batching. Between engine steps the worker admits waiting requests (FIFO)
while the engine has room (`engine.can_add`: up to its max_running, bounded by KV memory), then runs
one `engine.step()`, which scores every running request's tree in one target pass and returns each
one's delta; a request that finishes leaves at once and the next waiting one joins before the next
step. Waiting requests sit in a bounded queue (`max_queue` waiting beyond the ones that can run
now; past it, `submit` raises `QueueFull`). All model work runs in the worker thread, so the
asyncio event loop stays responsive during long target passes.

Cancellation: `abort(request_id)` on a waiting request removes it at once; on a running request it
sets a flag the worker reads between steps (`engine.abort_request`), so the request ends within one
engine step and its slot is freed. `abort_lag_steps` of the final report counts the engine steps
finished after the abort call (at most 1: the step that was in flight).

Shutdown: `drain(timeout)` refuses new requests, gives the waiting and running ones up to
`timeout` seconds, then aborts the rest; `stop()` then ends the worker.

Retry-After: the work ahead of a new request (running + waiting, in rounds of max_running) times the
mean request time, a conservative `DEFAULT_REQUEST_SECONDS` until a request has finished, never less
than the time the oldest running request has taken so far.

Faults: an `EngineFault` (device-level: the engine maps CUDA runtime errors to it) marks the loop
unhealthy and fails every request; requests a step fails (`StepOutput.failures`, `OutOfMemory`
included) fail alone and the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.types import (
    EngineFault,
    EngineUnavailable,
    FinishReason,
    GenerationEngine,
    PassStats,
    QueueFull,
    Request,
    StepOutput,
    TokenDelta,
)

log = logging.getLogger("specexec.loop")

SCHEDULING_POLICY = "continuous-batching"
DEFAULT_REQUEST_SECONDS = 30.0  # assumed duration of a request before any has finished (over-estimate)
MAX_RETRY_AFTER = 60  # seconds; the openai SDK ignores a longer Retry-After
DRAIN_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class JobReport:
    """Handed to `on_finish` after a request leaves the loop (from the worker thread; from the
    caller's thread when a still-waiting request is aborted or the loop stops)."""

    request_id: str
    finish_reason: FinishReason
    num_steps: int
    aborted: bool
    abort_lag_steps: int | None  # steps finished after abort() was called; None if not aborted
    seconds: float


@dataclass(eq=False)
class _Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    abort_event: threading.Event = field(default_factory=threading.Event)
    num_steps: int = 0
    abort_step: int | None = None
    started: float | None = None  # clock() when the worker took it

    def put(self, item: TokenDelta | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class DeltaStream:
    """Async iterator over one request's deltas; ends after the delta with `finish_reason`."""

    def __init__(self, owner: AsyncEngine, job: _Job):
        self._owner = owner
        self._job = job
        self._done = False
        self.request_id = job.request.request_id

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        item = await self._job.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._owner.abort(self.request_id)
            self._done = True


class AsyncEngine:
    """Serves an engine's steps to asyncio callers; see the module docstring for the policy."""

    def __init__(
        self,
        engine: GenerationEngine,
        max_queue: int,
        on_delta: Callable[[TokenDelta], None] | None = None,
        on_finish: Callable[[JobReport], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        on_step: Callable[[PassStats], None] | None = None,
    ):
        self.engine = engine
        self.max_queue = max_queue
        self._on_delta = on_delta
        self._on_finish = on_finish
        self._on_step = on_step
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: dict[str, _Job] = {}  # admitted to the engine, by request id
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._fault: BaseException | None = None
        self._clock = clock
        self._mean_seconds: float | None = None  # EWMA of request durations (None: none finished yet)

    # -- state ---------------------------------------------------------------------------
    @property
    def max_running(self) -> int:
        return self.engine.max_running

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._fault is None

    @property
    def fault(self) -> BaseException | None:
        return self._fault

    def retry_after(self) -> int:
        with self._wakeup:
            return self._retry_after()

    def _retry_after(self) -> int:
        """Seconds until the work now queued is done: rounds of max_running requests (running +
        waiting) x the mean request time. The caller holds the lock."""
        num_ahead = len(self._waiting) + self.num_running
        per_request = DEFAULT_REQUEST_SECONDS if self._mean_seconds is None else self._mean_seconds
        started = [job.started for job in self._running.values() if job.started is not None]
        if started:
            per_request = max(per_request, self._clock() - min(started))
        rounds = max(1, math.ceil(num_ahead / max(self.max_running, 1)))
        return max(1, min(MAX_RETRY_AFTER, math.ceil(per_request * rounds)))

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._work, name="specexec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and join the worker (a step in flight finishes first)."""
        with self._wakeup:
            self._stopping = True
            jobs = list(self._waiting) + list(self._running.values())
            self._wakeup.notify_all()
        for job in jobs:
            self.abort(job.request.request_id)
        if self._thread is not None:
            self._thread.join(timeout)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, wait up to `timeout` seconds for the waiting and running ones, then
        abort the rest; returns how many were aborted. Their streams end at once with
        FinishReason.ABORT: running requests' step in flight finishes in the worker, which goes on
        (stop() ends it), but their clients do not wait for that step (seconds when offloading)."""
        with self._wakeup:
            self._draining = True
        deadline = time.monotonic() + timeout
        while (self._waiting or self._running) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        with self._wakeup:
            running, jobs = list(self._running.values()), [*self._waiting]
        for job in jobs + running:
            self.abort(job.request.request_id)
        for job in running:
            job.put(TokenDelta(job.request.request_id, [], FinishReason.ABORT))  # the worker's is unread
        return len(jobs) + len(running)

    # -- API -----------------------------------------------------------------------------
    def submit(self, request: Request) -> DeltaStream:
        """Queue a request; raises QueueFull or EngineUnavailable at once (before any await)."""
        job = _Job(request, asyncio.get_running_loop())
        with self._wakeup:
            if self._draining:
                raise EngineUnavailable("the server is shutting down")
            if self._stopping or not self.healthy:
                raise EngineUnavailable(str(self._fault) if self._fault else "engine loop is not running")
            room_to_run = max(0, self.max_running - self.num_running)
            if len(self._waiting) >= self.max_queue + room_to_run:
                raise QueueFull(self.max_queue, self._retry_after())
            self._waiting.append(job)
            self._wakeup.notify()
        return DeltaStream(self, job)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; True if it was still waiting or running."""
        with self._wakeup:
            running = self._running.get(request_id)
            if running is not None:
                if not running.abort_event.is_set():
                    running.abort_step = running.num_steps
                    running.abort_event.set()
                    self._wakeup.notify()
                return True
            for job in self._waiting:
                if job.request.request_id == request_id:
                    self._waiting.remove(job)
                    job.abort_step = 0
                    job.abort_event.set()
                    break
            else:
                return False
        job.put(TokenDelta(request_id, [], FinishReason.ABORT))
        self._report(job, FinishReason.ABORT, 0.0)
        return True

    # -- worker --------------------------------------------------------------------------
    def _admit(self) -> list[_Job] | None:
        """Wait for work; move waiting jobs the engine has room for to running. None: stop."""
        with self._wakeup:
            while not self._waiting and not self._running and not self._stopping:
                self._wakeup.wait()
            if self._stopping:
                return None
            admitted = []
            while self._waiting and self.num_running + len(admitted) < self.max_running:
                job = self._waiting.popleft()
                job.started = self._clock()
                admitted.append(job)
            for job in admitted:
                self._running[job.request.request_id] = job
            return admitted

    def _work(self) -> None:
        while (admitted := self._admit()) is not None:
            for job in admitted:
                self._add(job)
            for job in [job for job in list(self._running.values()) if job.abort_event.is_set()]:
                delta = self.engine.abort_request(job.request.request_id)
                self._finish(job, delta or TokenDelta(job.request.request_id, [], FinishReason.ABORT))
            if not self._running:
                continue
            try:
                output = self.engine.step()
            except EngineFault as exc:
                log.exception("device fault: the engine is down")
                self._fail_all(exc)
                return
            except Exception as exc:  # a bug outside any one request: fail the running ones, go on
                log.exception("engine step failed")
                output = StepOutput(failures=[(rid, exc) for rid in list(self._running)])
                for rid in output.failures:
                    self.engine.abort_request(rid[0])
            self._dispatch(output)
        for job in list(self._running.values()):  # stop(): running requests end with ABORT
            delta = self.engine.abort_request(job.request.request_id)
            self._finish(job, delta or TokenDelta(job.request.request_id, [], FinishReason.ABORT))

    def _add(self, job: _Job) -> None:
        try:
            if not self.engine.can_add:
                raise RuntimeError("the engine has no free KV slot")
            self.engine.add_request(job.request)
        except Exception as exc:  # e.g. a context length the server did not catch: this request alone
            log.exception("request %s could not start", job.request.request_id)
            self._finish(job, exc)

    def _dispatch(self, output: StepOutput) -> None:
        for delta in output.deltas:
            job = self._running.get(delta.request_id)
            if job is None:
                continue
            if delta.stats is not None:
                job.num_steps += 1
            if delta.finish_reason is not None:
                self._finish(job, delta)
            else:
                job.put(delta)
            self._callback(self._on_delta, delta)
        for request_id, exc in output.failures:
            job = self._running.get(request_id)
            if job is not None:
                log.error("request %s failed: %s", request_id, exc)
                self._finish(job, exc)
        if output.stats is not None:
            self._callback(self._on_step, output.stats)

    def _callback(self, callback: Callable[[Any], None] | None, value: object) -> None:
        if callback is None:
            return
        try:
            callback(value)
        except Exception:
            log.exception("callback failed")

    def _finish(self, job: _Job, item: TokenDelta | BaseException) -> None:
        """Free the running slot, then hand the client its last item (a client that has its answer
        never finds its own request still counted as running), then report."""
        with self._wakeup:
            self._running.pop(job.request.request_id, None)
        job.put(item)
        reason = item.finish_reason if isinstance(item, TokenDelta) else FinishReason.ERROR
        assert reason is not None
        seconds = 0.0 if job.started is None else self._clock() - job.started
        if reason != FinishReason.ABORT:
            mean = self._mean_seconds
            self._mean_seconds = seconds if mean is None else 0.8 * mean + 0.2 * seconds
        self._report(job, reason, seconds)

    def _fail_all(self, exc: EngineFault) -> None:
        with self._wakeup:
            self._fault = exc
            jobs = [*self._running.values(), *self._waiting]
            self._running.clear()
            self._waiting.clear()
        for each in jobs:
            each.put(exc)
            self._report(each, FinishReason.ERROR, 0.0)

    def _report(self, job: _Job, reason: FinishReason, seconds: float) -> None:
        if self._on_finish is None:
            return
        aborted = job.abort_event.is_set() or reason == FinishReason.ABORT
        lag = None if job.abort_step is None else job.num_steps - job.abort_step
        report = JobReport(job.request.request_id, reason, job.num_steps, aborted, lag, seconds)
        try:
            self._on_finish(report)
        except Exception:
            log.exception("on_finish callback failed")
