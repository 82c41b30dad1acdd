"""One request through the AsyncEngine: token deltas -> safe text pieces, finish reason, usage, timings.

`Generation` is shared by streaming (server/sse.py) and non-streaming (`collect_response`)
responses, so both produce the same text. A stop string ends the text at once; the engine
request is then aborted and drained (at most one more step) so its totals are known and its
state is freed before the next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from engine.async_engine import AsyncEngine
from engine.types import (
    EngineUnavailable,
    FinishReason,
    GenerationStats,
    QueueFull,
    Request,
    TokenDelta,
    TokenLogprob,
)
from server.detok import TextStream
from server.errors import engine_down, generation_error, queue_full, shutting_down
from server.harmony_output import HarmonyOutput
from server.json_pieces import dumps_in_pieces
from server.logprobs import LogprobFormat
from server.metrics import Metrics
from server.preparation import Lane
from server.reasoning import ReasoningSplitter
from server.reasoning_tokens import reasoning_tokens
from server.responses import Envelope
from server.toolcalls.output import Delta, ToolOutput
from server.trace import StepTrace

log = logging.getLogger("specexec.server")

DISCONNECT_POLL_SECONDS = 0.25


class GenerationFailed(RuntimeError):
    """The engine failed this request after it was accepted."""


class Generation:
    def __init__(self, async_engine: AsyncEngine, request: Request, text: TextStream, metrics: Metrics,
                 endpoint: str, *, logprobs: LogprobFormat | None = None,
                 tools: ToolOutput | HarmonyOutput | None = None,
                 reasoning: ReasoningSplitter | None = None, trace: StepTrace | None = None):
        self.request = request
        # None: plain text; else reads tool calls out of the text (server/toolcalls/), or a harmony model's
        # channels: reasoning, content and calls (server/harmony_output.py)
        self.tools = tools
        self.reasoning = reasoning  # None: no reasoning block to read apart; else server/reasoning.py
        self._reasoning_tokens = reasoning_tokens(reasoning, tools)  # None: no reasoning to count
        self.trace = trace  # None: not asked for; else the speculation trace (server/trace.py)
        self.text = text
        self.metrics = metrics
        self.endpoint = endpoint
        self.finish_reason: str | None = None
        self.totals: GenerationStats | None = None
        self._async_engine = async_engine
        self._logprobs = logprobs  # None: not requested
        self._logprob_ids: list[int] = []  # consumed tokens whose logprobs are not taken yet
        self._logprob_entries: list[TokenLogprob] = []
        self._returned = GenerationStats()  # passes, tokens and seconds of the steps the text consumed
        try:
            self._stream = async_engine.submit(request)  # raises before any byte is sent
        except QueueFull as exc:
            raise queue_full(exc.retry_after) from None
        except EngineUnavailable as exc:
            raise engine_down(str(exc)) from None
        metrics.prompt_tokens.inc(len(request.prompt_ids))

    def deltas(self, piece: str) -> list[Delta]:
        """One piece of text as deltas: reasoning (server/reasoning.py), then content and tool calls
        (server/toolcalls/output.py; the calls are read from the content only)."""
        if self.reasoning is None:
            return self._content_deltas(piece)
        return self._part_deltas(self.reasoning.feed(piece))

    def finish_deltas(self) -> list[Delta]:
        """The deltas held back until the end, read with the finish reason (after `pieces`: "length" means
        cut off, so tool-call markup begun there is dropped, on every surface)."""
        out = [] if self.reasoning is None else self._part_deltas(self.reasoning.finish())
        return out + ([] if self.tools is None else self.tools.finish(self.finish_reason))

    def message(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]] | None]:
        """The whole text: (reasoning, None without a block; content; tool calls)."""
        reasoning = None
        if self.reasoning is not None:  # never beside a HarmonyOutput, which reads its own reasoning
            reasoning, text = self.reasoning.split(text)
        if self.tools is None:
            return reasoning, text, None
        own, content, calls = self.tools.whole(text, self.finish_reason)
        return (reasoning if own is None else own), content, calls

    def _part_deltas(self, parts: list[tuple[str, str]]) -> list[Delta]:
        out: list[Delta] = []
        for kind, text in parts:
            out += [Delta(reasoning=text)] if kind == "reasoning" else self._content_deltas(text)
        return out

    def _content_deltas(self, text: str) -> list[Delta]:
        return [Delta(content=text)] if self.tools is None else self.tools.feed(text)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return self.text.num_tokens

    @property
    def num_reasoning_tokens(self) -> int | None:
        """Of `completion_tokens`, those of the reasoning (server/reasoning_tokens.py); None: the output
        has no reasoning read apart (no think tags nor harmony, --reasoning-format none, completions)."""
        return None if self._reasoning_tokens is None else self._reasoning_tokens.num_tokens

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
            if self.trace is not None:
                self.trace.observe(delta, counted=not self.text.stopped)
            if delta.finish_reason is not None:
                self.totals = delta.totals
            was_stopped = self.text.stopped
            consumed = self.text.num_tokens
            piece = self._feed_text(delta.token_ids)
            self._keep_logprobs(delta, self.text.num_tokens - consumed)
            if not was_stopped:
                self._count_step(delta, self.text.num_tokens - consumed)
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

    def _feed_text(self, token_ids: list[int]) -> str:
        """The text of a delta's tokens; each token's own text also goes to the reasoning count."""
        if self._reasoning_tokens is None:
            return self.text.feed(token_ids)
        texts: list[str] = []
        piece = self.text.feed(token_ids, texts)
        for text in texts:
            self._reasoning_tokens.feed(text)
        return piece

    def _keep_logprobs(self, delta: TokenDelta, num_consumed: int) -> None:
        """The logprobs of the tokens the text consumed (up to a stop string's last token), except
        special tokens the text leaves out (so entries and text offsets follow the text)."""
        if self._logprobs is not None and delta.logprobs is not None:
            for token_id, entry in zip(delta.token_ids[:num_consumed], delta.logprobs[:num_consumed], strict=True):
                if not self.text.drops(token_id):
                    self._logprob_ids.append(token_id)
                    self._logprob_entries.append(entry)

    @property
    def prediction_tokens(self) -> tuple[int, int] | None:
        """(accepted, rejected) tokens of the predicted output once finished: those the answer followed, the
        rest of it (OpenAI's usage fields; the engine's count); None without a prediction."""
        if not self.request.prediction_ids or self.totals is None:
            return None
        accepted = min(self.totals.accepted_prediction_tokens, self.completion_tokens)
        return accepted, max(0, self.totals.prediction_tokens - accepted)

    def _count_step(self, delta: TokenDelta, num_consumed: int) -> None:
        """Count one engine step into the returned totals with the `num_consumed` of its tokens the text
        took (fewer when a stop string ended the text inside the step). Its kept tokens come first in
        the step's order, accepted draft tokens before the bonus, as the engine cuts at EOS."""
        stats = delta.stats
        if stats is None:  # an abort's or a failure's final delta: no step
            return
        returned = self._returned
        first = returned.target_passes == 0  # the prompt's own pass: its seconds are the prefill's
        returned.add_step(dataclasses.replace(stats, num_emitted=num_consumed,
                                              num_accepted=min(stats.num_accepted, num_consumed)), decode=not first)

    def take_logprobs(self, empty_as_none: bool = False) -> dict[str, Any] | None:
        """The logprobs object of the tokens consumed since the last call; None if not requested."""
        if self._logprobs is None or (empty_as_none and not self._logprob_ids):
            return None
        ids, entries = self._logprob_ids, self._logprob_entries
        self._logprob_ids, self._logprob_entries = [], []
        return self._logprobs.format(ids, entries)

    def halt(self) -> None:
        """End the text here (a limit the caller checks, like /infill's n_indent): as after a stop string,
        the engine request is aborted and drained, so its totals are still known; finish reason "stop"."""
        if not self.text.stopped:
            self.text.halt()
            self._async_engine.abort(self.request_id)

    def cancel(self) -> None:
        """Give up the request before reading it (another choice of the same response failed)."""
        self._finish("abort")

    def _end(self, reason: FinishReason) -> str:
        """Set the finish reason; return the text held back until the end."""
        if self.text.stopped:
            self._finish("stop")
            return ""
        if reason == FinishReason.ABORT:  # not asked for by this client: the server is shutting down
            self._finish("abort")
            raise shutting_down()
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

    def stats(self) -> GenerationStats:
        """This choice's totals over what it returned: the engine's prompt figures, and the passes, accepted
        tokens and seconds of the steps up to the one that ended the text. After a stop string the engine
        totals also hold the rest of that step's tokens and the step drained after it; these do not."""
        engine = self.totals or GenerationStats()
        return dataclasses.replace(self._returned, prompt_tokens=engine.prompt_tokens,
                                   cached_tokens=engine.cached_tokens, prefill_seconds=engine.prefill_seconds)

    def timings(self) -> dict[str, Any]:
        return timings(self.stats(), self.prompt_tokens, self.completion_tokens)


async def collect_response(request: HTTPRequest, gens: list[Generation], env: Envelope, render: Lane) -> Response:
    """Non-streaming: gather each choice's text; a client that goes away, or a choice that fails,
    aborts every engine request of the response. The body is built and written in `render` (a
    preparation lane: off the event loop, in pieces)."""
    texts = await collect_texts(request, gens, env.id)
    if texts is None:
        return Response(status_code=499)
    content = await render.run(completion_body, gens, texts, env)
    return Response(content, media_type="application/json", headers={"x-request-id": env.id})


def completion_body(gens: list[Generation], texts: list[str], env: Envelope) -> bytes:
    """The JSON of a whole response: each choice's content, calls and logprobs, usage and timings."""
    choices = []
    for index, (gen, text) in enumerate(zip(gens, texts, strict=True)):
        assert gen.finish_reason is not None
        reasoning, content, calls = gen.message(text)
        reason = gen.finish_reason if gen.tools is None else gen.tools.finish_reason(gen.finish_reason)
        choice = env.choice(index, content, reason, gen.take_logprobs(), tool_calls=calls, reasoning=reasoning)
        if gen.trace is not None:  # the whole choice's speculation trace (server/trace.py)
            choice["specexec"] = gen.trace.take(gen.text.num_tokens, final=True)
        choices.append(choice)
    return dumps_in_pieces(env.completion(choices, choices_usage(gens), choices_timings(gens)))


async def collect_texts(request: HTTPRequest, gens: list[Generation], response_id: str) -> list[str] | None:
    """Each choice's whole text; None when the client went away (every engine request aborted). A
    choice that fails aborts the others and raises its HTTP error."""

    async def run(gen: Generation) -> str:
        return "".join([piece async for piece in gen.pieces()])

    tasks = [asyncio.ensure_future(run(gen)) for gen in gens]
    try:
        while not all(task.done() for task in tasks):
            done, _ = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_SECONDS,
                                         return_when=asyncio.FIRST_EXCEPTION)
            if any(not task.cancelled() and task.exception() is not None for task in done):
                break
            if await request.is_disconnected():
                return None
        return [task.result() for task in tasks]  # raises the first failure
    except Exception as exc:
        error = generation_error(exc)
        if error.status == 500:
            log.exception("request %s failed", response_id)
        raise error from None
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def choices_usage(gens: list[Generation]) -> dict[str, Any]:
    """The response's usage: the prompt counted once (as OpenAI does for n > 1), completions summed;
    prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served (the first choice's);
    completion_tokens_details.reasoning_tokens: their reasoning tokens (server/reasoning_tokens.py);
    accepted_prediction_tokens / rejected_prediction_tokens: with a `prediction`, its tokens the answers
    followed and the rest."""
    prompt_tokens = gens[0].prompt_tokens
    completion_tokens = sum(gen.completion_tokens for gen in gens)
    cached = gens[0].totals.cached_tokens if gens[0].totals is not None else 0
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": cached}}
    reasoning = [gen.num_reasoning_tokens for gen in gens if gen.num_reasoning_tokens is not None]
    details: dict[str, int] = {}
    if reasoning:  # a model that reasons (OpenAI's and vLLM's field); absent otherwise, as before
        details["reasoning_tokens"] = sum(reasoning)
    predicted = [gen.prediction_tokens for gen in gens if gen.prediction_tokens is not None]
    if predicted:  # a chat request with a `prediction` (OpenAI's Predicted Outputs)
        details["accepted_prediction_tokens"] = sum(accepted for accepted, _ in predicted)
        details["rejected_prediction_tokens"] = sum(rejected for _, rejected in predicted)
    if details:
        usage["completion_tokens_details"] = details
    return usage


def choices_timings(gens: list[Generation]) -> dict[str, Any]:
    """`timings` over every choice: each choice prefilled the prompt and decoded its own tokens."""
    if len(gens) == 1:
        return gens[0].timings()
    total = GenerationStats()
    for gen in gens:
        for name, value in vars(gen.stats()).items():
            setattr(total, name, getattr(total, name) + value)
    return timings(total, total.prompt_tokens, sum(gen.completion_tokens for gen in gens))


def timings(totals: GenerationStats | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Speculation statistics (beyond OpenAI), in the spirit of llama.cpp's `timings`."""
    t = totals or GenerationStats()
    passes = t.target_passes
    # the tokens of the prompt's own pass are timed with the prompt: when they are all there is, that
    # pass is also the generation's time (predicted_ms then overlaps prompt_ms)
    decode_seconds = t.decode_seconds or (t.prefill_seconds if completion_tokens else 0.0)
    accepted = min(t.accepted_tokens, completion_tokens)  # a bound: `stats()` counts returned tokens only
    return {
        "prompt_n": prompt_tokens,
        "cache_n": t.cached_tokens,  # of prompt_n, served by the prefix cache
        "prompt_ms": round(t.prefill_seconds * 1000, 3),
        "prompt_tokens_per_second": _rate(prompt_tokens, t.prefill_seconds),
        "predicted_n": completion_tokens,
        "predicted_ms": round(decode_seconds * 1000, 3),
        "generation_tokens_per_second": _rate(completion_tokens, decode_seconds),
        "target_passes": passes,
        "draft_tokens_accepted": accepted,
        # tokens returned per target pass: accepted draft tokens + the target's bonus token
        "mean_accepted_per_pass": round(completion_tokens / passes, 4) if passes else 0.0,
        "mean_draft_accepted_per_pass": round(accepted / passes, 4) if passes else 0.0,
    }


def _rate(num_tokens: int, seconds: float) -> float:
    return round(num_tokens / seconds, 3) if seconds > 0 else 0.0

