"""The workloads `specexec bench serve` sends to one running server; each returns a raw JSON entry.

- `run_streams`: N concurrent code-completion streams sent at once.
- `run_interrupt`: a short request sent while a long one streams.
- `run_turns`: a chat's first turn, then its second turn (first turn + reply + a new message).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import httpx

from bench.prompts import CHAT_PROMPTS, CODE_PROMPTS
from bench.serve_client import Clock, StreamResult, chat_body, completion_body, scrape, stream_request
from bench.serve_metrics import num_passes, pass_figures, total

WARMUP_TOKENS = 4
TURN2_TOKENS = 4  # turn 2 is measured up to its first tokens
IDLE_TIMEOUT = 300.0  # seconds for a cut-off request to leave the engine
# the server hands a step's tokens to the stream just before it counts the pass in /metrics: a scrape
# waits this long after the tokens it is timed by
SETTLE_SECONDS = 0.02


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    """One running server as the workloads address it."""

    client: httpx.AsyncClient
    url: str
    source: str
    variant: str

    @property
    def completions(self) -> str:
        return f"{self.url}/v1/completions"

    @property
    def chat(self) -> str:
        return f"{self.url}/v1/chat/completions"

    def entry(self, kind: str, **fields: object) -> dict:
        return {"kind": kind, "source": self.source, "variant": self.variant, **fields}


def code_prompt(tag: str, index: int) -> str:
    """Code prompt `index` under a comment naming the setting: no two settings share a prompt, so
    none reuses another's prefix cache, and every server variant gets the same prompts."""
    return f"# bench {tag}\n{CODE_PROMPTS[index % len(CODE_PROMPTS)]}"


async def wait_idle(server: Target) -> None:
    """Until the server runs and queues nothing (a cut-off request leaves within one engine step)."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    while time.monotonic() < deadline:
        samples = await scrape(server.client, server.url)
        if not total(samples, "specexec_requests_running") and not total(samples, "specexec_queue_depth"):
            return
        await asyncio.sleep(0.1)
    raise BenchError(f"{server.url}: requests still running after {IDLE_TIMEOUT:.0f} s")


def failed(exc: BaseException) -> StreamResult:
    return StreamResult(sent=0.0, error=f"{type(exc).__name__}: {exc}"[:500])


async def warm_up(server: Target) -> None:
    """One untimed request: first-pass allocations, the streaming ring's start."""
    body = completion_body(code_prompt("warm-up", 0), WARMUP_TOKENS, 0.0, 0)
    result = await stream_request(server.client, server.completions, body, Clock())
    if result.error is not None:
        raise BenchError(f"warm-up request failed: {result.error}")


async def run_streams(server: Target, temperature: float, num_streams: int, max_tokens: int, seed: int) -> dict:
    """`num_streams` requests sent at once; pass figures from /metrics before and after."""
    await wait_idle(server)
    tag = f"T{temperature:g} x{num_streams}"
    bodies = [completion_body(code_prompt(f"{tag} stream {i}", i), max_tokens, temperature, seed + i)
              for i in range(num_streams)]
    before = await scrape(server.client, server.url)
    clock = Clock()
    outcomes = await asyncio.gather(
        *(stream_request(server.client, server.completions, body, clock) for body in bodies), return_exceptions=True
    )
    after = await scrape(server.client, server.url)
    streams = [failed(o) if isinstance(o, BaseException) else o for o in outcomes]
    return server.entry("streams", temperature=temperature, num_streams=num_streams, max_tokens=max_tokens,
                        streams=[asdict(s) for s in streams], pass_figures=pass_figures(before, after))


async def first_of(event: asyncio.Event, task: asyncio.Task) -> None:
    """Until `event` is set or `task` ends (a request that fails before its first token)."""
    waiter = asyncio.ensure_future(event.wait())
    await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


async def run_interrupt(server: Target, long_tokens: int, short_tokens: int, seed: int) -> dict:
    """Greedy: the long request streams; once it has text, the short one is sent. Passes waited: the
    target passes that finished between sending the short request and its first token, its own
    included (from /metrics)."""
    await wait_idle(server)
    clock = Clock()
    long, short = StreamResult(sent=0.0), StreamResult(sent=0.0)
    long_first, short_first = asyncio.Event(), asyncio.Event()
    long_body = completion_body(code_prompt("long", 0), long_tokens, 0.0, seed)
    short_body = completion_body(code_prompt("short", 1), short_tokens, 0.0, seed + 1)
    long_task = asyncio.create_task(stream_request(server.client, server.completions, long_body, clock, long,
                                                   long_first))
    await first_of(long_first, long_task)
    await asyncio.sleep(SETTLE_SECONDS)
    before = await scrape(server.client, server.url)
    short_task = asyncio.create_task(stream_request(server.client, server.completions, short_body, clock, short,
                                                    short_first))
    await first_of(short_first, short_task)
    await asyncio.sleep(SETTLE_SECONDS)
    at_first_token = await scrape(server.client, server.url)
    long_task.cancel()  # the client goes away: the server aborts the long request within one step
    await asyncio.gather(long_task, return_exceptions=True)
    await asyncio.gather(short_task, return_exceptions=True)
    end = short.first_token if short.first_token is not None else clock.now()
    return server.entry(
        "interrupt", long_max_tokens=long_tokens, short_max_tokens=short_tokens, long=asdict(long),
        short=asdict(short), passes_waited=num_passes(before, at_first_token),
        long_chunks_waited=sum(short.sent <= t <= end for t in long.chunk_times),
    )


async def run_turns(server: Target, turn_tokens: int, prefix_cache: str, seed: int) -> dict:
    """Greedy chat: turn 1, then turn 2 = turn 1's messages + the reply + a new user message."""
    await wait_idle(server)
    clock = Clock()
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    turn1 = await stream_request(server.client, server.chat, chat_body(messages, turn_tokens, 0.0, seed), clock)
    messages += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": CHAT_PROMPTS[1]}]
    await wait_idle(server)
    turn2 = await stream_request(server.client, server.chat, chat_body(messages, TURN2_TOKENS, 0.0, seed), clock)
    return server.entry("turn", prefix_cache=prefix_cache, turn1=asdict(turn1), turn2=asdict(turn2))
