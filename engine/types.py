"""The server <-> engine contract: plain data, no tensors in the public fields.

`GenerationEngine` is everything the server (and any other caller) may use of an engine; the errors
below are everything the engine raises on purpose. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id, or (server side) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"


MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs bound)
# Sampling parameter bounds: within them, processed fp32 logits stay finite (no NaN, no inf but masks).
GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy (argmax), as in vLLM
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's bound)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # 1 is off (HF/vLLM meaning; both only require > 0)
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values (OpenAI's bound)

# how a request's tokens are found (engine.config.SpeculationConfig.method; Request.method per request)
SpeculationMethod = Literal["specexec", "specinfer", "rrs", "autoregressive"]
StructuredOutputKind = Literal["json_object", "json_schema", "regex", "structural_tag"]
STRUCTURED_OUTPUT_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "structural_tag")
JSON_WHITESPACE: tuple[str, ...] = ("compact", "free")


@dataclass(frozen=True)
class ReasoningBlock:
    """A reasoning block the output may begin with before its constrained part (a reasoning model's
    `<think> ... </think>`): optional whitespace, `open`, any text without `close`, `close`, optional
    whitespace; then the grammar's own output. `opened`: the prompt already opened the block, so the
    output begins inside it (any text, `close`, then the rest) and the block is not optional."""

    open: str = "<think>"
    close: str = "</think>"
    opened: bool = False

    def __post_init__(self) -> None:
        if not self.open or not self.close:
            raise StructuredOutputError("a reasoning block needs both its open and close tags")


@dataclass(frozen=True)
class StructuredOutput:
    """Output constrained by a grammar: any JSON object (json_object), JSON valid under a JSON schema
    (json_schema; `spec` is the schema as JSON text), text matching a regular expression (regex;
    `spec` is the pattern), or an xgrammar structural tag (structural_tag; `spec` is its JSON text,
    `{"type": "structural_tag", "format": {...}}`: text, tags and JSON schemas combined, as tool
    calls need). Compiled and checked by the engine (`validate_structured_output`).

    The tokenizer's special tokens never appear in the output, except those named in
    `special_tokens` (by their text, e.g. a tool-call marker "[TOOL_CALLS]"): the grammar reads
    these as their text.

    `json_whitespace` (JSON: json_object, json_schema, and the JSON schemas of a structural tag):
    "compact", the separators ", " and ": " and no other whitespace between elements (as json.dumps
    and the chat templates print JSON: a model cannot spend its tokens on whitespace); "free", any
    whitespace between elements, at most 16 characters per gap.

    `reasoning`: a reasoning block the output may begin with (its tags read as their text, as
    `special_tokens` are); the grammar then applies after it, as vLLM applies structured outputs
    after a reasoning parser's block. None: the grammar applies from the first token."""

    kind: StructuredOutputKind
    spec: str = ""  # "" for json_object
    special_tokens: tuple[str, ...] = ()
    json_whitespace: str = "compact"
    reasoning: ReasoningBlock | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise StructuredOutputError(f"kind must be one of {STRUCTURED_OUTPUT_KINDS}, got {self.kind!r}")
        if self.json_whitespace not in JSON_WHITESPACE:
            raise StructuredOutputError(f"json_whitespace must be one of {JSON_WHITESPACE}, got {self.json_whitespace!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included): greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-prob and the k most likely alternatives
    structured_output: StructuredOutput | None = None  # None: free text; else every token obeys the grammar

    def __post_init__(self) -> None:
        """Raises SamplingParamsError naming the field for a value out of its documented range."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        require_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        require_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be >= 0, got {self.top_k!r}")
        require_range("min_p", self.min_p, 0.0, 1.0)
        require_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        require_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        require_range("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        for value in self.logit_bias.values():
            require_range("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens!r}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature below GREEDY_TEMPERATURE (dividing logits by it would overflow)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def acceptance_key(self) -> float:
        """The sampling regime budget auto keys its acceptance curves by: 0.0 greedy, else the temperature."""
        return 0.0 if self.greedy else self.temperature

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def require_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    """value in [low, high] ((low, high] if low_open), finite; else SamplingParamsError naming `name`."""
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise SamplingParamsError(name, f"must be in {bounds}, got {value!r}")


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # the speculation method this request runs under (None: the engine's); "autoregressive" runs it
    # without a draft, one token per target pass; the others need the engine's draft
    method: SpeculationMethod | None = None
    # a predicted output's token ids (OpenAI's `prediction`): grafted into each SpecExec tree as a chain
    prediction_ids: list[int] | None = None


@dataclass(frozen=True)
class StepStats:
    """One request's part of one engine step: its draft tree in the step's one target pass."""

    tree_size: int  # this request's nodes scored by the target, root included
    num_accepted: int  # draft tokens accepted (bonus token excluded)
    num_emitted: int  # tokens emitted this step (accepted + bonus, after stop truncation)
    draft_seconds: float  # the step's draft phase (every running request's tree)
    target_seconds: float  # the step's one target pass (shared by batch_size requests)
    step_seconds: float
    batch_size: int = 1  # requests whose trees the pass scored
    pass_tokens: int = 0  # tokens the pass scored: every request's tree and prompt tokens prefilled in it
    expected_accepted: float | None = None  # E[num_accepted | this tree] (sample-and-match); None: not known
    overlap_seconds: float = 0.0  # draft work beside the target pass (overlap), within target_seconds
    extension_forwards: int = 0  # draft passes beside the target pass (overlap), all requests' together


@dataclass(frozen=True)
class PassStats:
    """One engine step as a whole (metrics): one target pass over every running request."""

    num_requests: int  # requests that got tokens from this pass
    num_tree_nodes: int  # tree nodes scored, every request's root included
    num_prefill_tokens: int  # prompt tokens written in this pass (joining requests), cache hits excluded
    num_emitted: int  # tokens emitted to all requests
    draft_seconds: float
    target_seconds: float
    step_seconds: float
    overlap_seconds: float = 0.0  # draft work beside the target pass, within target_seconds
    extension_forwards: int = 0  # draft passes beside the target pass
    draft_forwards: int = 0  # draft passes before the target pass (every tree's growth together, catch-up included)
    seeded_trees: int = 0  # trees grown on from a seed (the last pass's extension: overlap), not afresh


@dataclass
class StepOutput:
    """What one engine step produced: deltas of running requests, requests that failed alone, the pass."""

    deltas: list[TokenDelta] = field(default_factory=list)
    failures: list[tuple[str, BaseException]] = field(default_factory=list)  # (request_id, error)
    stats: PassStats | None = None  # None when no target pass ran


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token under the request's processed distribution
    (greedy: the penalised logits before temperature), and the most likely alternatives there."""

    logprob: float
    top_ids: list[int]  # the params.logprobs most likely token ids, most likely first
    top_logprobs: list[float]  # their log-probabilities (-inf where processing removed the token)


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request; the last delta carries `finish_reason`."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: StepStats | None = None
    totals: GenerationStats | None = None  # set on the final delta
    logprobs: list[TokenLogprob] | None = None  # one per token id when params.logprobs is set


@dataclass
class GenerationStats:
    """Totals over one request."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    completion_tokens: int = 0
    target_passes: int = 0
    accepted_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prediction_tokens: int = 0  # a predicted output's tokens (chat's `prediction`; 0: none)
    accepted_prediction_tokens: int = 0  # generated tokens that followed the prediction where it stood

    def add_step(self, stats: StepStats, decode: bool = True) -> None:
        """Count a step's tokens; its seconds only if `decode` (a request's first step, which also
        writes its prompt, is timed as prefill_seconds)."""
        self.target_passes += 1
        self.accepted_tokens += stats.num_accepted
        self.completion_tokens += stats.num_emitted
        if not decode:
            return
        self.decode_seconds += stats.step_seconds
        self.draft_seconds += stats.draft_seconds
        self.target_seconds += stats.target_seconds

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens emitted per target pass (accepted draft tokens + bonus)."""
        return self.completion_tokens / self.target_passes if self.target_passes else 0.0


class ContextLengthError(ValueError):
    """prompt + max_tokens does not fit the context."""

    def __init__(self, prompt_len: int, max_tokens: int, max_context: int):
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_context = max_context
        super().__init__(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it (the request field of the same name)."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name} {message}")


class StructuredOutputError(ValueError):
    """A structured-output spec the engine cannot compile: a JSON schema or regex it does not support
    or cannot parse, or a model without a tokenizer. The message says what is wrong."""


class EngineFault(RuntimeError):
    """A device-level failure: the engine cannot serve any request until restarted."""


class OutOfMemory(RuntimeError):
    """The device ran out of memory during one request: that request fails, its memory is freed and
    the engine goes on. The message says what ran out and what to change."""


class ConfigError(ValueError):
    """A config value is invalid; `field` names it (dotted, e.g. `speculation.budget`)."""

    def __init__(self, field_name: str, message: str, source: str | None = None):
        self.field = field_name
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field_name}: {message}")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or unsupported."""


class VocabMismatchError(CheckpointError):
    """The draft's vocabulary does not match the target's token ids."""


class OffloadError(RuntimeError):
    """Streaming the target's layers failed: a read or copy error, a bad layout, not enough memory."""


class QueueFull(RuntimeError):
    """The bounded wait queue is full: the request is refused (HTTP 429)."""

    def __init__(self, max_queue: int, retry_after: int):
        self.max_queue = max_queue
        self.retry_after = retry_after  # seconds, an estimate from recent request durations
        super().__init__(f"request queue is full ({max_queue} waiting)")


class EngineUnavailable(RuntimeError):
    """The loop is not running, or a device fault took the engine down."""


class GenerationEngine(Protocol):
    """What the server needs of an engine (`engine.runtime.Engine`; the tests' FakeEngine).

    add_request / abort_request / step run in one worker thread (the AsyncEngine's); the other
    members are read-only after load."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase (chat template, encode, decode)
    model_name: str
    max_context: int  # prompt + completion tokens
    eos_token_ids: frozenset[int]
    max_running: int  # requests one step serves at most

    def validate_request(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError (ContextLengthError when too long) for a request that cannot run."""
        ...

    def validate_structured_output(self, spec: StructuredOutput) -> None:
        """Compile `spec` for this model's tokenizer (cached for the request that follows); raise
        StructuredOutputError for one that cannot be compiled. Blocking: call it off the event loop."""
        ...

    @property
    def can_add(self) -> bool:
        """Whether add_request takes another request now (fewer than max_running, a free KV slot)."""
        ...

    def add_request(self, request: Request) -> None:
        """Admit a request; the next step starts it. Raises ValueError (ContextLengthError) for one
        that cannot run."""
        ...

    def abort_request(self, request_id: str) -> TokenDelta | None:
        """Drop a running request between steps; its final delta (ABORT), None if it is not running."""
        ...

    def step(self) -> StepOutput:
        """One engine step over the running requests: a delta for each (the last one of a request has
        finish_reason and totals), the requests that failed alone (OutOfMemory: the step's requests
        fail, the next step may run), the pass's stats. Raises EngineFault on a device failure (the
        engine cannot serve any request until restarted)."""
        ...

    def close(self) -> None:
        """Release what the engine runs beside its steps (the layer streamer's thread); after the
        last step. Idempotent."""
        ...
