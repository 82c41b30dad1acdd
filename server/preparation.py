"""The server's own executors for preparing requests, split by kind and size, so no client holds up another.

Preparing a request (parsing and validating its JSON, rendering the chat template, tokenizing) and compiling
its grammar run in threads, off the event loop. asyncio's default executor is one shared pool: six slow
requests filled it and a 4-token completion waited 40 s behind them. Here each kind has two lanes of its own:

- a small lane for work whose input is small (a body up to SMALL_BODY_BYTES, a grammar spec up to
  SMALL_SPEC_BYTES): such work takes milliseconds, and large work never enters this lane, so a small
  request waits only behind other small ones;
- a large lane: one worker (a large job keeps a core busy; the engine keeps the others), and at most
  LARGE_WAITING jobs waiting. Past that a request is refused at once with a 429 (`server_busy`, Retry-After)
  rather than queued behind work of unknown length.

The threads of the large lanes and of the grammar lanes run at a lower CPU priority (nice +WORKER_NICE,
Linux; threads they start, such as xgrammar's compile threads, inherit it): when cores are short, the
engine's thread, the event loop and the small lane run first, so preparing one large request slows
neither the tokens of others nor the preparation of small ones.

Whole (non-streamed) response bodies are built and written in a `render` lane of their own, in pieces
(server/json_pieces.py): an n=8, top_logprobs=20 reply is hundreds of thousands of values.

A grammar compile may wait at most `grammar_timeout` seconds for a worker (then a 429) and take at most
`grammar_timeout` seconds of its own: past that the request is a 400 naming the field. The compile cannot
be interrupted; it finishes in the background, still holding its worker, and lands in the engine's
grammar cache.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from server.errors import APIError

T = TypeVar("T")

SMALL_BODY_BYTES = 64 * 1024  # a body this size parses and tokenizes in milliseconds
SMALL_SPEC_BYTES = 8 * 1024  # a schema or regex this size compiles in well under a second
SMALL_WORKERS = 4
SMALL_GRAMMAR_WORKERS = 2
LARGE_WAITING = 4  # large jobs that may wait for a lane's worker; more are refused (429)
RENDER_WORKERS = 2
BUSY_RETRY_SECONDS = 5
WORKER_NICE = 10


class PreparationTimeout(Exception):
    """A job ran past its time limit (it goes on in its worker; its result is dropped)."""


def server_busy(lane: str) -> APIError:
    return APIError(429, f"The server is busy preparing other large requests ({lane}). Retry later, or send a "
                    "smaller request.", type="rate_limit_error", code="server_busy",
                    headers={"Retry-After": str(BUSY_RETRY_SECONDS)}, retry=True)


class DaemonPool:
    """A fixed set of daemon worker threads: unlike ThreadPoolExecutor's, a job still running (a compile
    past its time limit) does not hold up the process's exit."""

    def __init__(self, workers: int, name: str, nice: int = 0):
        self.workers = workers
        self.name = name
        self.nice = nice  # added to the nice value of each worker thread
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # started by the first submit

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if not self._threads:
            self._threads = [threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                             for i in range(self.workers)]
            for thread in self._threads:
                thread.start()
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        if self.nice:
            lower_priority(self.nice)
        while (item := self._jobs.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Workers end after their current job; jobs still queued are cancelled."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


def lower_priority(nice: int) -> None:
    """This thread's nice value +`nice` where threads have their own (Linux); elsewhere nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError):
        pass


class Lane:
    """A thread pool with an admission bound: at most `workers + max_waiting` jobs admitted and not yet
    finished (a job that ran past its caller's time limit counts until it ends); None: unbounded."""

    def __init__(self, name: str, workers: int, max_waiting: int | None, nice: int = 0):
        self.name = name
        self.workers = workers
        self.max_waiting = max_waiting
        self._pool = DaemonPool(workers, f"specexec-{name}", nice)
        self._lock = threading.Lock()
        self.num_admitted = 0  # jobs submitted and not yet finished (or cancelled before they began)

    async def run(self, fn: Callable[..., T], *args: object, time_limit: float | None = None) -> T:
        """fn(*args) in a worker; a 429 if the lane is full, or if the job waits `time_limit` seconds
        for a worker; PreparationTimeout past `time_limit` seconds counted from the moment it starts."""
        with self._lock:
            if self.max_waiting is not None and self.num_admitted >= self.workers + self.max_waiting:
                raise server_busy(self.name)
            self.num_admitted += 1
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def job() -> T:
            loop.call_soon_threadsafe(_resolve, started)
            return fn(*args)

        try:
            future = self._pool.submit(job)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(self._release)  # also when cancelled before it began
        return await _wait(future, started, time_limit, self.name)

    def _release(self, _: Future | None = None) -> None:
        with self._lock:
            self.num_admitted -= 1

    def shutdown(self) -> None:
        self._pool.shutdown()


async def _wait(future: Future[T], started: asyncio.Future[None], time_limit: float | None, lane: str) -> T:
    """The job's result; with a time limit, it may wait at most that long for a worker (then 429, the
    job dropped) and run at most that long (then PreparationTimeout). Cancelled: a job not begun is dropped."""
    result = asyncio.wrap_future(future)
    if time_limit is None:
        return await result
    try:
        done, _ = await asyncio.wait([result, started], timeout=time_limit, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done and future.cancel():  # still queued: dropped (else it began just now: let it run)
        raise server_busy(lane)
    try:
        return await asyncio.wait_for(asyncio.shield(result), time_limit)
    except TimeoutError:
        raise PreparationTimeout from None


def _resolve(started: asyncio.Future[None]) -> None:
    if not started.done():
        started.set_result(None)


class Preparation:
    """The lanes of one server: `prepare` (parse, template, tokenize), `grammar` (compile), and `render`
    (a whole response's body, built and written in pieces: never refused, as its request already ran)."""

    def __init__(self, grammar_timeout: float):
        self.grammar_timeout = grammar_timeout
        self.small = Lane("prepare-small", SMALL_WORKERS, None)
        self.large = Lane("prepare-large", 1, LARGE_WAITING, WORKER_NICE)
        self.small_grammar = Lane("grammar-small", SMALL_GRAMMAR_WORKERS, None, WORKER_NICE)
        self.large_grammar = Lane("grammar-large", 1, LARGE_WAITING, WORKER_NICE)
        self.render = Lane("render", RENDER_WORKERS, None, WORKER_NICE)

    def lane(self, body_bytes: int) -> Lane:
        """The lane for preparing a request whose body has `body_bytes` bytes."""
        return self.small if body_bytes <= SMALL_BODY_BYTES else self.large

    async def compile(self, fn: Callable[..., T], spec_bytes: int, *args: object) -> T:
        """fn(*args) in a grammar lane under the compile time limit (PreparationTimeout past it)."""
        lane = self.small_grammar if spec_bytes <= SMALL_SPEC_BYTES else self.large_grammar
        return await lane.run(fn, *args, time_limit=self.grammar_timeout)

    def shutdown(self) -> None:
        for lane in (self.small, self.large, self.small_grammar, self.large_grammar, self.render):
            lane.shutdown()
