"""`POST /infill`: llama.cpp server's code-infill endpoint (llama.vscode's client), over the same engine.

Request fields (llama.cpp names): `model` is ignored, as llama.cpp's single-model server ignores it
(llama.vscode sends its own `ai_model` setting there, `"google/gemini-2.5-flash"` by default); `input_prefix`, `input_suffix`, `input_extra` (list of
{filename, text} chunks placed before the prefix, server/fim.py), `prompt` (text appended after the
prefix), `n_predict` (-1 or absent: the server's default; 0: nothing is generated, the response only
reports the prompt's size, as llama.vscode's cache-warming requests expect), `temperature`, `top_k`,
`top_p`, `min_p` (absent: llama.cpp's defaults 0.8 / 40 / 0.95 / 0.05), `seed` (-1: random),
`repeat_penalty`, `presence_penalty`, `frequency_penalty`, `logit_bias` ({"id": bias} or [[id, bias]],
bias `false` bans the token), `ignore_eos`, `stop`, `stream`, and as llama.cpp's server does
`t_max_predict_ms` (once that long has passed since the first generated text and a newline was
generated, the completion stops) and `n_indent` (a generated line indented by fewer spaces or tabs
stops the completion before that line's text). Scheduling and cache fields llama.cpp also takes
(`cache_prompt`, `id_slot`, `samplers`, `t_max_prompt_ms`, `n_cmpl`) are accepted and ignored;
`n_probs` > 0 is a 400.

A prompt longer than the context minus `n_predict` is cut as llama.cpp cuts it (server/fim.py `fit`)
and the response says `"truncated": true`.

Response: `{"content", "stop": true, "stop_type": "eos" | "limit" | "word", "stopping_word",
"tokens_predicted", "tokens_evaluated", "tokens_cached" (prompt tokens the prefix cache served),
"truncated", "timings", ...}`; a t_max_predict_ms or n_indent stop is "limit". Streamed: `data: {"content":
piece, "stop": false, ...}` events, then that final object with `"content": ""` (no `[DONE]`, as
llama.cpp); an error after the first byte is one `data: {"error": ...}` event.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from engine.types import MAX_LOGIT_BIAS, REPETITION_PENALTY_RANGE, SamplingParams
from engine.types import Request as EngineRequest
from server.detok import TextStream
from server.errors import APIError, generation_error, invalid_request, unsupported
from server.fim import FimFormat, FimParts, fit
from server.generation import Generation
from server.json_body import load_json_object
from server.limits import read_body
from server.protocol import SamplingRequest, check_supported
from server.responses import new_request_id
from server.state import ServerState

ENDPOINT = "infill"
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
EXTRA_CHUNK_CHARS = 16  # what an input_extra chunk's separator and file name line count for, in characters


class InfillChunk(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    filename: str = "tmp"
    text: str = ""


class InfillRequest(SamplingRequest):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = Field(None, ge=-1)
    repeat_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    logit_bias: dict[str, float] | list[list[int | float | bool]] | None = None  # type: ignore[assignment]
    n_probs: int | None = None
    t_max_predict_ms: int | None = Field(None, ge=0)  # 0: no limit
    n_indent: int | None = Field(None, ge=0)  # 0: no limit

    prompt_param: ClassVar[str] = "input_prefix"

    def requested_max_tokens(self) -> int | None:
        if self.n_predict is not None and self.n_predict >= 0:
            return self.n_predict
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        fields: dict[str, Any] = {k: v for k, v in LLAMA_CPP_DEFAULTS.items() if getattr(self, k) is None}
        if self.repeat_penalty is not None and self.repetition_penalty is None:
            fields["repetition_penalty"] = self.repeat_penalty
        if self.seed is not None and self.seed < 0:
            fields["seed"] = None
        fields["logit_bias"] = _bias_dict(self.logit_bias)
        return SamplingRequest.to_sampling_params(self.model_copy(update=fields), max_tokens, vocab_size)


def _bias_dict(bias: dict[str, float] | list[list[int | float | bool]] | None) -> dict[str, float] | None:
    """llama.cpp's [[token_id, bias | false], ...] as OpenAI's {"token_id": bias}."""
    if not isinstance(bias, list):
        return bias
    out: dict[str, float] = {}
    for pair in bias:
        if len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int):
            raise invalid_request("logit_bias pairs must be [token_id, bias].", "logit_bias")
        value = pair[1]
        try:
            out[str(pair[0])] = -float(MAX_LOGIT_BIAS) if value is False else float(value)
        except OverflowError:  # an integer too large for a float: out of range like any other
            raise invalid_request(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}].",
                                  "logit_bias") from None
    return out


def parse_infill(raw: bytes) -> InfillRequest:
    try:
        request = InfillRequest.model_validate(load_json_object(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        raise invalid_request(f"Invalid value for '{param}': {first['msg']}.", param, "invalid_value") from None
    check_supported(request)
    if request.n is not None and request.n > 1:
        raise unsupported("n", "/infill returns one completion; n must be 1.")
    if request.n_probs:
        raise unsupported("n_probs", "n_probs is not supported by /infill.")
    return request


async def infill(request: Request) -> Response:
    state: ServerState = request.app.state.specexec
    try:
        return await _infill(request, state)
    except APIError as exc:
        state.metrics.rejected.labels(ENDPOINT, str(exc.status)).inc()
        raise


async def _infill(request: Request, state: ServerState) -> Response:
    config = state.server_config
    raw = await read_body(request, config.max_body_bytes, config.read_timeout)
    lane = state.preparation.lane(len(raw))  # the server's own threads for bodies of this size
    req = await lane.run(parse_infill, raw)
    async_engine, prompt = state.require_ready()  # `model` is ignored, as by llama.cpp's single-model server
    if prompt.fim is None:
        raise invalid_request("This model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <fim_prefix> "
                              "or <PRE>), so /infill cannot build a prompt for it.", None, "fim_not_supported")
    requested = req.requested_max_tokens()  # None: the default, fitted to the room the prompt leaves
    output_room = requested or min(prompt.default_max_tokens, prompt.max_context // 2)
    parts = await lane.run(_parts, prompt.fim, req, prompt.max_prompt_chars)
    parts, truncated = fit(parts, max(prompt.max_context - output_room, 0))
    prompt_ids = prompt.fim.assemble(parts)
    model = state.model_name
    if requested == 0:  # llama.vscode warms the server's cache with these: nothing to generate
        return JSONResponse(final_body("", model, len(prompt_ids), truncated, {"predicted_n": 0}))
    params = await lane.run(req.to_sampling_params, prompt.max_tokens(req, len(prompt_ids)), prompt.vocab_size)
    params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + prompt.fim.stop_ids)
    text = TextStream(prompt.tokenizer, req.stop_strings())
    gen = Generation(async_engine, EngineRequest(new_request_id(False), prompt_ids, params), text,
                     state.metrics, ENDPOINT)
    limits = Limits(req.t_max_predict_ms or 0, req.n_indent or 0)
    if req.stream:
        return EventSourceResponse(_events(gen, limits, model, truncated), sep="\n", ping=config.ping_seconds,
                                   ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"),
                                   client_close_handler_callable=lambda _: _abort(async_engine, gen))
    try:
        content = "".join([piece async for piece in limited(gen, limits)])
    except Exception as exc:
        raise generation_error(exc) from None
    return JSONResponse(_final(gen, limits, content, model, truncated))


class Limits:
    """llama.cpp's t_max_predict_ms and n_indent, checked on the text as it is generated."""

    def __init__(self, max_predict_ms: int, n_indent: int):
        self.max_predict_ms = max_predict_ms
        self.n_indent = n_indent
        self.hit = False
        self._text = ""
        self._line_start = 0  # where the line after the last newline checked begins
        self._started: float | None = None

    def feed(self, piece: str) -> str:
        """The part of `piece` to keep; sets `hit` when a limit ends the completion."""
        if self._started is None:
            self._started = time.monotonic()
        begin = len(self._text)
        self._text += piece
        while self.n_indent:  # every line after a newline, as its indentation becomes known
            if self._line_start and self._short_line():
                return self._text[begin:]
            newline = self._text.find("\n", self._line_start)
            if newline < 0:
                break
            self._line_start = newline + 1
        elapsed_ms = (time.monotonic() - self._started) * 1000
        if self.max_predict_ms and elapsed_ms > self.max_predict_ms and "\n" in self._text:
            self.hit = True
        return piece

    def _short_line(self) -> bool:
        """llama.cpp's check: the line begun at _line_start has text after fewer than n_indent spaces or
        tabs; the text is cut after that indentation."""
        pos = self._line_start
        while pos < len(self._text) and self._text[pos] in " \t":
            pos += 1
        if pos < len(self._text) and pos - self._line_start < self.n_indent:
            self._text, self.hit = self._text[:pos], True
            return True
        return False


async def limited(gen: Generation, limits: Limits) -> AsyncIterator[str]:
    """The generation's pieces until a limit ends the text (then it is halted and drained)."""
    async for piece in gen.pieces():
        if limits.hit:
            continue
        kept = limits.feed(piece)
        if kept:
            yield kept
        if limits.hit:
            gen.halt()


def _parts(fim: FimFormat, req: InfillRequest, max_chars: int) -> FimParts:
    """The prompt's pieces. Every text field is cut to what any context could hold before it is
    tokenized (`fit` would cut the same tokens): the prefix with `prompt` after it keeps its last
    `max_chars` characters, the suffix its first, the extra context its newest chunks up to `max_chars`."""
    prompt = req.prompt[-max_chars:]
    room = max_chars - len(prompt)
    prefix = req.input_prefix[max(0, len(req.input_prefix) - room) :] if room > 0 else ""
    return fim.parts(prefix, req.input_suffix[:max_chars], prompt, _newest_extra(req.input_extra, max_chars))


def _newest_extra(chunks: list[InfillChunk], max_chars: int) -> list[tuple[str, str]]:
    """(filename, text) of the newest chunks within `max_chars` characters, each chunk counting
    EXTRA_CHUNK_CHARS more for its separator; the oldest one kept may lose the start of its text."""
    kept: list[tuple[str, str]] = []
    room = max_chars
    for chunk in reversed(chunks):
        room -= EXTRA_CHUNK_CHARS + len(chunk.filename)
        if room <= 0:
            break
        text = chunk.text[max(0, len(chunk.text) - room) :]
        room -= len(text)
        kept.append((chunk.filename, text))
    return kept[::-1]


async def _abort(async_engine: Any, gen: Generation) -> None:
    async_engine.abort(gen.request_id)


async def _events(gen: Generation, limits: Limits, model: str, truncated: bool) -> AsyncIterator[str]:
    try:
        async for piece in limited(gen, limits):
            yield _dumps({"index": 0, "content": piece, "tokens": [], "stop": False, "id_slot": 0,
                          "tokens_predicted": gen.completion_tokens, "tokens_evaluated": gen.prompt_tokens})
        yield _dumps(_final(gen, limits, "", model, truncated))
    except Exception as exc:  # the stream has begun: report in-band
        yield _dumps(generation_error(exc).body())
    finally:
        gen.cancel()


def _final(gen: Generation, limits: Limits, content: str, model: str, truncated: bool) -> dict[str, Any]:
    stopping_word = gen.text.stop_string or ""
    stop_type = "limit" if gen.finish_reason == "length" or limits.hit else "word" if stopping_word else "eos"
    body = final_body(content, model, gen.prompt_tokens, truncated, gen.timings())
    cached = gen.totals.cached_tokens if gen.totals is not None else 0
    return body | {"tokens_predicted": gen.completion_tokens, "tokens_cached": cached, "stop_type": stop_type,
                   "stopping_word": stopping_word, "has_new_line": "\n" in content}


def final_body(content: str, model: str, prompt_tokens: int, truncated: bool,
               timings: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's last /completion object (generation_settings trimmed to what applies here)."""
    return {
        "index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": model,
        "tokens_predicted": 0, "tokens_evaluated": prompt_tokens, "tokens_cached": 0, "truncated": truncated,
        "stop_type": "limit", "stopping_word": "", "has_new_line": "\n" in content,
        "timings": _llama_timings(timings),
    }


def _llama_timings(timings: dict[str, Any]) -> dict[str, Any]:
    """Ours plus llama.cpp's rate names (`prompt_per_second`, `predicted_per_second`)."""
    return timings | {"prompt_per_second": timings.get("prompt_tokens_per_second", 0.0),
                      "predicted_per_second": timings.get("generation_tokens_per_second", 0.0)}


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
