"""A FakeEngine implementing the server's contract (`GenerationEngine`): a deterministic token stream,
no model.

It cycles through the token ids of `script` (multi-byte characters split across tokens),
`tokens_per_step` ids per step, honours max_tokens, EOS/stop token ids, should_abort, and
can sleep per step or fail, for fast tests of the HTTP layer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import lru_cache

from engine.async_engine import AsyncEngine, JobReport
from engine.types import (
    ContextLengthError,
    EngineFault,
    FinishReason,
    GenerationEngine,
    GenerationStats,
    PassStats,
    Request,
    SamplingParams,
    StepOutput,
    StepStats,
    StructuredOutput,
    StructuredOutputError,
    TokenDelta,
    TokenLogprob,
)
from tests.helpers.tiny_models import build_tokenizer

SCRIPT = "Hello, world! Ünïcödé ✓ 日本語 🙂 The quick brown fox jumps over the lazy dog. "


@lru_cache(maxsize=1)
def tiny_tokenizer():
    return build_tokenizer()


class FakeEngine(GenerationEngine):
    def __init__(
        self,
        *,
        script: str = SCRIPT,
        tokens_per_step: int = 3,
        step_seconds: float = 0.0,
        max_context: int = 512,
        fail_with: BaseException | None = None,
        model_name: str = "fake-model",
        before_step: Callable[[], None] | None = None,
        max_running: int = 1,
    ):
        self.tokenizer = tiny_tokenizer()
        self.model_name = model_name
        self.max_context = max_context
        self.eos_token_ids = frozenset({self.tokenizer.eos_token_id})
        self.script_ids: list[int] = self.tokenizer.encode(script, add_special_tokens=False)
        self.tokens_per_step = tokens_per_step
        self.step_seconds = step_seconds
        self.before_step = before_step  # called in the worker thread at the start of every step
        self.fail_with = fail_with
        self.requests: list[Request] = []
        self.steps_run = 0  # request steps: one per running request per step()
        self.step_log: list[list[str]] = []  # the request ids each step() ran, in order
        self.step_started = threading.Event()
        self.max_running = max_running
        self._streams: dict[str, Iterator[TokenDelta]] = {}  # running requests' delta streams
        self._totals: dict[str, GenerationStats] = {}  # running requests' totals so far

    def validate_request(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt must contain at least one token")
        if prompt_len + max_tokens > self.max_context:
            raise ContextLengthError(prompt_len, max_tokens, self.max_context)

    def validate_structured_output(self, spec: StructuredOutput) -> None:
        """Compiles nothing (the fake ignores grammars): a json_schema must be a JSON object, a regex
        must not be empty."""
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.spec)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise StructuredOutputError("the JSON schema must be an object")
        if spec.kind == "regex" and not spec.spec:
            raise StructuredOutputError("the regex is empty")

    @property
    def can_add(self) -> bool:
        return len(self._streams) < self.max_running

    def add_request(self, request: Request) -> None:
        self.validate_request(len(request.prompt_ids), request.params.max_tokens)
        self._streams[request.request_id] = self.generate(request)

    def abort_request(self, request_id: str) -> TokenDelta | None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        stream.close()  # the totals so far, as the engine's scheduler reports them
        return TokenDelta(request_id, [], FinishReason.ABORT, totals=self._totals.pop(request_id, GenerationStats()))

    def close(self) -> None:
        self.closed = True

    def step(self) -> StepOutput:
        """One delta from each running request's stream, in admission order."""
        output = StepOutput()
        for request_id, stream in list(self._streams.items()):
            try:
                delta = next(stream)
            except EngineFault:
                raise
            except Exception as exc:  # this request fails alone
                del self._streams[request_id]
                output.failures.append((request_id, exc))
                continue
            output.deltas.append(delta)
            if delta.finish_reason is not None:
                del self._streams[request_id]
                self._totals.pop(request_id, None)
        self.step_log.append([delta.request_id for delta in output.deltas] + [rid for rid, _ in output.failures])
        if output.deltas:
            emitted = sum(len(d.token_ids) for d in output.deltas)
            output.stats = PassStats(len(output.deltas), 8 * len(output.deltas), 0, emitted, 0.001, 0.002, 0.003)
        return output

    def output_ids(self, request: Request, count: int) -> list[int]:
        """The first `count` ids this engine emits for `request` (before stop/EOS handling)."""
        offset = 0 if request.params.greedy else (request.params.seed or 0) % len(self.script_ids)
        return [self.script_ids[(offset + i) % len(self.script_ids)] for i in range(count)]

    def generate(self, request: Request, should_abort: Callable[[], bool] | None = None) -> Iterator[TokenDelta]:
        params = request.params
        self.validate_request(len(request.prompt_ids), params.max_tokens)
        self.requests.append(request)
        totals = self._totals[request.request_id] = GenerationStats(prompt_tokens=len(request.prompt_ids),
                                                                    prefill_seconds=0.001)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        stream = self.output_ids(request, params.max_tokens)
        emitted = 0
        while True:
            if should_abort is not None and should_abort():
                yield TokenDelta(request.request_id, [], FinishReason.ABORT, totals=totals)
                return
            self.step_started.set()
            if self.before_step is not None:
                self.before_step()
            if self.step_seconds:
                time.sleep(self.step_seconds)
            if self.fail_with is not None:
                raise self.fail_with
            new_ids = stream[emitted : emitted + self.tokens_per_step]
            finish = None
            for idx, token_id in enumerate(new_ids):
                if token_id in stop_ids:
                    new_ids, finish = new_ids[:idx], FinishReason.STOP
                    break
            emitted += len(new_ids)
            if finish is None and emitted >= params.max_tokens:
                finish = FinishReason.LENGTH
            self.steps_run += 1
            stats = StepStats(tree_size=8, num_accepted=max(len(new_ids) - 1, 0),
                              num_emitted=len(new_ids), draft_seconds=0.001, target_seconds=0.002,
                              step_seconds=0.003)
            totals.add_step(stats)
            logprobs = None if params.logprobs is None else [  # made-up values: the shapes are what is tested
                TokenLogprob(-0.5, [t] * params.logprobs, [-0.5] * params.logprobs) for t in new_ids]
            yield TokenDelta(request.request_id, new_ids, finish, stats, totals if finish else None, logprobs)
            if finish is not None:
                return


# -- driving an AsyncEngine over a FakeEngine ------------------------------------------------


def request(rid: str, max_tokens: int = 12, **params) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params))


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in stream]


def make_async_engine(engine: FakeEngine, max_queue: int = 4) -> tuple[AsyncEngine, list[JobReport]]:
    """A started AsyncEngine over `engine`, and the list its finish reports go to."""
    reports: list[JobReport] = []
    async_engine = AsyncEngine(engine, max_queue, on_finish=reports.append)
    async_engine.start()
    return async_engine, reports
