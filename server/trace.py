"""Our `specexec` request field on chat and completions: the speculation trace and the request's own method.

    "specexec": {"trace": true}                  every choice chunk (and a whole response's choices)
                                                 carries `specexec`: its tokens and passes
    "specexec": {"method": "autoregressive"}     this request runs without speculation (or with another
                                                 method: specexec, specinfer, rrs) through the same engine

A trace is made of what each engine step already reports (engine.types.StepStats on each TokenDelta):
a step's tokens are the accepted path's draft tokens, then the target's own token (the correction or
bonus token of the pass). Like logprobs, each chunk carries the tokens the text consumed since the
previous chunk, and the passes seen since then (docs/api.md, "Speculation trace"). Passes after a stop
string ended the text are left out, as their tokens are. Tracing reads; it never changes the tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.config import Method, SpeculationConfig
from engine.types import SamplingParams, TokenDelta
from server.detok import Decoder, Detokenizer, TextStream
from server.errors import invalid_request

Origin = Literal["draft", "target"]


class SpecexecOptions(BaseModel):
    """The request's `specexec` object (ours, beyond OpenAI)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    trace: bool | None = False
    method: Literal["specexec", "specinfer", "rrs", "autoregressive"] | None = None


def request_method(options: SpecexecOptions | None, speculation: SpeculationConfig) -> Method | None:
    """The method a request asks for (None: the server's). Without a draft (the server runs
    autoregressive) only autoregressive can run: another is a 400 naming `specexec.method`."""
    method = None if options is None else options.method
    if method not in (None, "autoregressive") and speculation.method == "autoregressive":
        raise invalid_request(f"specexec.method {method!r} needs a draft model; this server runs without one "
                              "(--method autoregressive).", "specexec.method", "invalid_value")
    return method


def tree_method(speculation: SpeculationConfig, method: Method | None, params: SamplingParams) -> str:
    """The trees the request's steps grow (the engine's rule: engine.config.SpeculationConfig.tree_method)."""
    if method is not None and method != speculation.method:
        speculation = dataclasses.replace(speculation, method=method)
    return speculation.tree_method(params.greedy, params.temperature, params.seed is not None)


class StepTrace:
    """One choice's trace: `observe` every engine delta before the text consumes it, `take` what a chunk
    carries (the tokens the text consumed since the last take, the passes seen since then)."""

    def __init__(self, tokenizer: Decoder, method: str, drop_ids: frozenset[int] | None = None):
        self.method = method
        self._detok = Detokenizer(tokenizer, drop_ids=drop_ids)  # each token's text, as the stream decodes it
        self._began = time.perf_counter()
        self._num_passes = 0
        self._num_taken = 0  # tokens already sent
        self._tokens: list[dict[str, Any]] = []  # observed, not yet sent
        self._passes: list[dict[str, Any]] = []
        self._sent_method = False

    def observe(self, delta: TokenDelta, counted: bool) -> None:
        """A delta from the engine; `counted`: the text had not ended before it (else its tokens are never
        returned, and its pass is left out)."""
        stats = delta.stats
        if stats is None or not counted:  # an abort's or failure's final delta: no step
            return
        self._num_passes += 1
        index = self._num_passes
        self._passes.append({
            "pass": index,
            "tree_size": stats.tree_size,
            "accepted": stats.num_accepted,
            "emitted": stats.num_emitted,
            "expected_accepted": None if stats.expected_accepted is None else round(stats.expected_accepted, 4),
            "batch_size": stats.batch_size,
            "draft_ms": _ms(stats.draft_seconds),
            "target_ms": _ms(stats.target_seconds),
            "step_ms": _ms(stats.step_seconds),
            "time_ms": _ms(time.perf_counter() - self._began),
        })
        for position, token_id in enumerate(delta.token_ids):
            origin: Origin = "draft" if position < stats.num_accepted else "target"
            self._tokens.append({"text": self._detok.add(token_id), "origin": origin, "pass": index})

    def take(self, num_consumed: int, final: bool = False) -> dict[str, Any]:
        """The trace of one chunk: tokens up to the text's `num_consumed`-th, and the passes seen since the
        last take; `final`: the last chunk. Tokens whose text is still empty at the end (the first bytes
        of a character) wait for the token that completes it; at the end, bytes left incomplete (U+FFFD,
        as the text ends with them) go with the last token."""
        count = max(0, num_consumed - self._num_taken)
        while not final and count and not self._tokens[count - 1]["text"]:
            count -= 1  # held back: a character its bytes begin, finished by a later token (or the flush)
        tokens, self._tokens = self._tokens[:count], self._tokens[count:]
        self._num_taken += len(tokens)
        if final and tokens and (rest := self._detok.flush()):
            tokens[-1]["text"] += rest
        out: dict[str, Any] = {}
        if not self._sent_method:
            self._sent_method = True
            out["method"] = self.method
        passes, self._passes = self._passes, []
        return out | {"tokens": tokens, "passes": passes}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def traced_chunks(trace: StepTrace | None, text: TextStream,
                  chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """A choice's stream chunks (its `text` consumes the tokens), each with its `specexec` trace in its
    choice (beside `logprobs`) when the request asked for one; the chunks themselves otherwise."""
    if trace is None:
        return chunks

    async def with_trace() -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in chunks:
                choice = chunk["choices"][0]
                choice["specexec"] = trace.take(text.num_tokens, final=choice["finish_reason"] is not None)
                yield chunk
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]  # an async generator

    return with_trace()
