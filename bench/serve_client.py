"""Streaming OpenAI-API requests with client-side timings: sent, first token, done.

Every request streams (`stream_options.include_usage`), so the client sees the first token when
the server sends it; the finish chunk's `timings` (this server's extension) give the request's
own target passes and prefill time, the usage chunk its `cached_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.serve_metrics import Samples, parse_metrics


@dataclass
class StreamResult:
    """One request as the client saw it; times in seconds since the clock's zero."""

    sent: float
    first_token: float | None = None  # the first chunk with text
    done: float | None = None  # [DONE] (None: cut off or failed)
    completion_tokens: int = 0  # usage (0 until the usage chunk)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    target_passes: int | None = None  # timings.target_passes: the passes this request took part in
    prefill_seconds: float | None = None  # timings.prompt_ms / 1000
    num_text_chunks: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk with text
    text: str = ""
    error: str | None = None


class Clock:
    def __init__(self) -> None:
        self.zero = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.zero


def completion_body(prompt: str, max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
    """/v1/completions: raw text continued for exactly `max_tokens` (EOS ignored)."""
    return {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }


def chat_body(messages: list[dict[str, str]], max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
    return {
        "messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
        "stream": True, "stream_options": {"include_usage": True},
    }


def new_client(num_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections + 4, max_keepalive_connections=num_connections + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits, trust_env=False)


def read_chunk(result: StreamResult, chunk: dict[str, Any], now: float) -> None:
    """Fold one `data:` payload into `result`."""
    if "error" in chunk:
        result.error = json.dumps(chunk["error"])[:500]
        return
    for choice in chunk.get("choices") or []:
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        if piece:
            if result.first_token is None:
                result.first_token = now
            result.num_text_chunks += 1
            result.chunk_times.append(now)
            result.text += piece
    timings = chunk.get("timings") or {}  # on the finish chunk
    if "target_passes" in timings:
        result.target_passes = int(timings["target_passes"])
        result.prefill_seconds = float(timings.get("prompt_ms", 0.0)) / 1000
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = int(usage.get("completion_tokens", 0))
        result.prompt_tokens = int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], clock: Clock, result: StreamResult | None = None,
    first_token: asyncio.Event | None = None,
) -> StreamResult:
    """POST one streaming request and read it to [DONE]. `result` (filled as chunks arrive) stays
    readable if the task is cancelled; `first_token` is set when the first text arrives."""
    result = result or StreamResult(sent=clock.now())
    result.sent = clock.now()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:500]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                result.done = clock.now()
                break
            read_chunk(result, json.loads(payload), clock.now())
            if first_token is not None and result.first_token is not None:
                first_token.set()
    return result


async def scrape(client: httpx.AsyncClient, base_url: str) -> Samples:
    response = await client.get(f"{base_url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)
