"""One request through the AsyncEngine: token deltas -> safe text pieces, finish reason, usage, timings.

`Generation` is shared by streaming (server/sse.py) and non-streaming (`collect_response`)
responses, so both produce the same text. A stop string ends the text at once; the engine
request is then aborted and drained (at most one more step) so its totals are known and its
state is freed before the next request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from engine.types import EngineUnavailable, FinishReason, GenerationStats, QueueFull, Request
from server.detok import TextStream
from server.errors import engine_down, generation_error, queue_full
from server.metrics import Metrics
from server.responses import Envelope

log = logging.getLogger("specexec.server")

DISCONNECT_POLL_SECONDS = 0.25


class GenerationFailed(RuntimeError):
    """The engine failed this request after it was accepted."""


class Generation:
    def __init__(self, async_engine: AsyncEngine, request: Request, text: TextStream, metrics: Metrics,
                 endpoint: str):
        self.request = request
        self.text = text
        self.metrics = metrics
        self.endpoint = endpoint
        self.finish_reason: str | None = None
        self.totals: GenerationStats | None = None
        self._async_engine = async_engine
        try:
            self._stream = async_engine.submit(request)  # raises before any byte is sent
        except QueueFull as exc:
            raise queue_full(exc.retry_after) from None
        except EngineUnavailable as exc:
            raise engine_down(str(exc)) from None
        metrics.prompt_tokens.inc(len(request.prompt_ids))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return self.text.num_tokens

    async def pieces(self) -> AsyncIterator[str]:
        """Yield text pieces; afterwards `finish_reason` and `totals` are set. Aborts if left early."""
        try:
            async for piece in self._pieces():
                yield piece
        except Exception:
            self._finish("error")
            raise
        finally:
            self._finish("abort")  # no-op unless left early (client gone, cancelled)

    async def _pieces(self) -> AsyncIterator[str]:
        async for delta in self._stream:
            if delta.finish_reason is not None:
                self.totals = delta.totals
            was_stopped = self.text.stopped
            piece = self.text.feed(delta.token_ids)
            if self.text.stopped and not was_stopped:
                self._async_engine.abort(self.request_id)  # then drain: the final delta comes within one step
            if piece:
                yield piece
            if delta.finish_reason is not None:
                tail = self._end(delta.finish_reason)
                if tail:
                    yield tail
                return
        raise GenerationFailed("the engine stream ended without a final delta")

    def _end(self, reason: FinishReason) -> str:
        """Set the finish reason; return the text held back until the end."""
        if self.text.stopped:
            self._finish("stop")
            return ""
        if reason == FinishReason.ABORT:
            raise GenerationFailed("the request was cancelled (server shutting down)")
        if reason == FinishReason.ERROR:
            raise GenerationFailed("the engine reported an error")
        tail = self.text.finish()
        self._finish("stop" if self.text.stopped else reason.value)
        return tail

    def _finish(self, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self._async_engine.abort(self.request_id)  # no-op when the engine already finished it
        self.metrics.generation_tokens.inc(self.completion_tokens)
        self.metrics.requests.labels(self.endpoint, reason).inc()

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def timings(self) -> dict[str, Any]:
        return timings(self.totals, self.prompt_tokens, self.completion_tokens)


async def collect_response(request: HTTPRequest, gen: Generation, env: Envelope) -> Response:
    """Non-streaming: gather the text; a client that goes away aborts the engine request."""
    parts: list[str] = []

    async def run() -> None:
        async for piece in gen.pieces():
            parts.append(piece)

    task = asyncio.ensure_future(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        task.result()
    except Exception as exc:
        error = generation_error(exc)
        if error.status == 500:
            log.exception("request %s failed", gen.request_id)
        raise error from None
    finally:
        if not task.done():
            task.cancel()
    assert gen.finish_reason is not None
    body = env.completion("".join(parts), gen.finish_reason, gen.usage(), gen.timings())
    return JSONResponse(body, headers={"x-request-id": env.id})


def timings(totals: GenerationStats | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Speculation statistics (beyond OpenAI), in the spirit of llama.cpp's `timings`."""
    t = totals or GenerationStats()
    passes = t.target_passes
    return {
        "prompt_n": prompt_tokens,
        "prompt_ms": round(t.prefill_seconds * 1000, 3),
        "prompt_tokens_per_second": _rate(prompt_tokens, t.prefill_seconds),
        "predicted_n": completion_tokens,
        "predicted_ms": round(t.decode_seconds * 1000, 3),
        "generation_tokens_per_second": _rate(completion_tokens, t.decode_seconds),
        "target_passes": passes,
        "draft_tokens_accepted": t.accepted_tokens,
        # tokens emitted per target pass: accepted draft tokens + the target's bonus token
        "mean_accepted_per_pass": round(t.mean_accepted_per_pass, 4),
        "mean_draft_accepted_per_pass": round(t.accepted_tokens / passes, 4) if passes else 0.0,
    }


def _rate(num_tokens: int, seconds: float) -> float:
    return round(num_tokens / seconds, 3) if seconds > 0 else 0.0

