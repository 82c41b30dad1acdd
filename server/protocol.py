"""Pydantic models of the OpenAI request shapes, the checks that go beyond types, and the
request -> `SamplingParams` conversion (`to_sampling_params`).

Requests are validated strictly (a string is not a number, a float is not an integer);
unknown fields are ignored. A supported-but-unimplemented option with a value that matters
(`best_of > 1`, `echo`, ...) is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.types import (
    MAX_LOGIT_BIAS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
)
from server.errors import APIError, invalid_request, unsupported
from server.json_body import load_json_object
from server.json_pieces import PieceError, validate_in_pieces
from server.tool_images import IMAGE_NOTE, IMAGE_PART, log_omitted
from server.trace import SpecexecOptions

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024  # per stop string: the stream holds back and re-checks up to this much text per token
SEED_MODULUS = 2**63  # seeds are reduced into the engine's non-negative int64 range
MAX_CHOICES = 8  # the largest `n` (each choice is one engine request)

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool | None = False


class ContentPart(_Model):
    type: str
    text: str | None = None


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; an object is accepted too


class ToolCall(_Model):
    """A call of a past assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that render it (Qwen3's; harmony templates read it as `thinking`: server/harmony_output.py)


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the grammar is always strict (only what the schema names)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(_Model):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI plus vLLM-style extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras beyond OpenAI (vLLM / llama.cpp names)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM: a JSON schema
    guided_regex: str | None = None  # vLLM: a regular expression
    specexec: SpecexecOptions | None = None  # ours: the speculation trace, the request's own method (server/trace.py)

    prompt_param: ClassVar[str]  # the field that holds the prompt, named by prompt errors

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine's `logprobs` (0: the chosen token's only); None: off."""
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The grammar the output must follow and the request field that asks for it (None: free text)."""
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            return "guided_json", StructuredOutput("json_schema", schema)
        if self.guided_regex is not None:
            return "guided_regex", StructuredOutput("regex", self.guided_regex)
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
            return "response_format", StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
        return "response_format", StructuredOutput("json_object")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingRequest:
        """A copy whose fields named in `defaults` (server/sampling_defaults.py: the target's
        generation_config.json) take the default where this request left them out or sent null."""
        missing = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        return self.model_copy(update=missing) if missing else self

    def to_sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's parameters; `max_tokens` is already resolved against the context, token ids
        are checked against `vocab_size` (a 400 naming the field)."""
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        if top_p == 0.0:  # the limit of top_p -> 0: only the most likely token
            top_p, top_k = 1.0, 1
        stop_token_ids = tuple(self.stop_token_ids or ())
        check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
        return checked_sampling_params(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._token_logit_bias(vocab_size),
            seed=None if self.seed is None else self.seed % SEED_MODULUS,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.num_logprobs(),
            structured_output=None if (grammar := self.structured_output()) is None else grammar[1],
        )

    def _token_logit_bias(self, vocab_size: int) -> dict[int, float]:
        """{"token id": bias} -> {token_id: bias}, every key a token id and every bias in range."""
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise invalid_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
            check_token_ids([token_id], vocab_size, "logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise invalid_request(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value}.", "logit_bias")
            out[token_id] = float(value)
        return out


def checked_sampling_params(**fields: Any) -> SamplingParams:
    """SamplingParams(**fields); a value the engine refuses (out of its range) is a 400 naming the field."""
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as exc:
        raise invalid_request(f"{exc}.", exc.field, "invalid_value") from None


class PredictedOutput(_Model):
    """OpenAI's Predicted Outputs: text much of the answer is expected to repeat (a file being edited). Here
    its tokens are grafted into every SpecExec tree as a chain (engine.speculation.prediction)."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    prediction: PredictedOutput | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM / llama.cpp: extra template variables
    # a template variable (GPT-OSS's reads it; chat_template_kwargs' own wins); None: the template's default
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    prompt_param: ClassVar[str] = "messages"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI allows 5; vLLM 20

    prompt_param: ClassVar[str] = "prompt"

    def num_logprobs(self) -> int | None:
        return self.logprobs


_FIELD_NAMES = {
    name
    for cls in (ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions, ToolCall,
                FunctionCall, ToolDefinition, FunctionDefinition, NamedToolChoice, ResponseFormat, JsonSchemaFormat,
                SpecexecOptions)
    for name in cls.model_fields
}

RequestT = TypeVar("RequestT", bound=SamplingRequest)


def parse_request(raw: bytes, cls: type[RequestT]) -> RequestT:
    """JSON bytes -> validated request, or a 400 naming the offending field."""
    return validate_request(load_json_object(raw), cls)


def validate_request(body: dict[str, Any], cls: type[RequestT]) -> RequestT:
    """A parsed JSON body -> validated request, or a 400 naming the offending field."""
    try:
        request = validate_in_pieces(cls, body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except PieceError as exc:
        raise field_error(exc.error) from None
    check_supported(request)
    return request


def validation_error(exc: ValidationError) -> APIError:
    return field_error(exc.errors()[0])


def field_error(first: Any) -> APIError:
    """The 400 of one pydantic error (a dict with loc, type and msg)."""
    param = error_param(first["loc"])
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return invalid_request(f"Invalid value for '{param}': {first['msg']}.", param, "invalid_value")


def error_param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union member tags are dropped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELD_NAMES:
            param += f".{part}" if param else part
    return param or str(loc[0])


def validated_as(cls: type[SamplingRequest], body: dict[str, Any], rename: Callable[[str | None], str | None],
                 message: str = "{param}: {msg}") -> SamplingRequest:
    """Another API's request mapped onto `cls` (chat or completions), validated and checked as that route
    checks it; errors name the other API's field (`rename`) in its words (`message`)."""
    try:
        request = cls.model_validate({k: v for k, v in body.items() if v is not None})
        check_supported(request)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = rename(error_param(first["loc"]))
        raise invalid_request(message.format(param=param, msg=first["msg"]), param, "invalid_value") from None
    except APIError as exc:
        exc.param = rename(exc.param)
        raise
    return request


def check_supported(request: SamplingRequest) -> None:
    if request.n is not None and request.n > MAX_CHOICES:
        raise invalid_request(f"n must be at most {MAX_CHOICES}, got {request.n}.", "n", "invalid_value")
    if request.stream_options is not None and not request.stream:
        raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options")
    stops = request.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(f"At most {MAX_STOP_STRINGS} stop sequences are supported.", "stop")
    if any(s == "" for s in stops):
        raise invalid_request("Stop sequences must be non-empty strings.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid_request(f"Stop sequences may have at most {MAX_STOP_CHARS} characters.", "stop")
    _check_structured_output(request)
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request)
    elif isinstance(request, CompletionRequest):
        _check_completion(request)


def _check_chat(request: ChatCompletionRequest) -> None:
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
    _check_tool_choice(request)
    if request.functions:
        raise unsupported("functions", "Function calling is not supported by this server.")
    num_images = 0  # in tool messages: each is rendered as a note (server/tool_images.py)
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type == IMAGE_PART and message.role == "tool":
                    num_images += 1
                elif part.type != "text" or part.text is None:
                    raise unsupported(f"messages[{i}].content[{j}]",
                                      f"Only text content parts are supported, got type '{part.type}'.")
    log_omitted(num_images)


def _check_structured_output(request: SamplingRequest) -> None:
    """At most one of response_format (other than text), guided_json, guided_regex; json_schema needs
    its `json_schema` object. Whether the engine can compile the grammar is checked with the model."""
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise invalid_request("response_format type 'json_schema' needs 'json_schema': {\"name\": ..., "
                              "\"schema\": {...}}.", "response_format.json_schema", "missing_required_parameter")
    given = [name for name, value in (("response_format", fmt is not None and fmt.type != "text"),
                                      ("guided_json", request.guided_json is not None),
                                      ("guided_regex", request.guided_regex is not None)) if value]
    if len(given) > 1:
        raise invalid_request(f"Give at most one of {', '.join(given)}.", given[1])


def _check_tool_choice(request: ChatCompletionRequest) -> None:
    """`tool_choice` "required" or a named function needs tools (and that function among them);
    whether the model can call tools is checked with the model (server/toolcalls/plan.py)."""
    choice = request.tool_choice
    if choice in (None, "auto", "none"):
        return
    names = [tool.function.name for tool in request.tools or []]
    if not names:
        raise invalid_request("tool_choice requires 'tools' to be given.", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid_request(f"tool_choice names the function '{choice.function.name}', which is not in "
                              "'tools'.", "tool_choice")


def _check_completion(request: CompletionRequest) -> None:
    if request.echo:
        raise unsupported("echo", "echo is not supported by this server.")
    if request.best_of is not None and request.best_of > 1:
        raise unsupported("best_of", "Only best_of=1 is supported.")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
        raise unsupported("prompt", "Only one prompt per request is supported.")
    if prompt == "" or prompt == [] or prompt == [""] or prompt == [[]]:
        raise invalid_request("The prompt must not be empty.", "prompt")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid_request(f"Token id {bad[0]} is out of range [0, {vocab_size}).", param)


def message_text(message: ChatMessage) -> str:
    """A message's content as text: its parts joined by newlines, an image (in a tool message) as a note."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(IMAGE_NOTE if part.type == IMAGE_PART else part.text or "" for part in message.content)
