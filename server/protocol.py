"""Pydantic models of the OpenAI request shapes, and the checks that go beyond types.

Requests are validated strictly (a string is not a number, a float is not an integer);
unknown fields are ignored. A supported-but-unimplemented option with a value that matters
(`n > 1`, `logprobs`, tools, ...) is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import APIError, invalid_request, unsupported

MAX_STOP_STRINGS = 32

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool | None = False


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None


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
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=5)


_FIELD_NAMES = {
    name
    for cls in (ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions)
    for name in cls.model_fields
}

RequestT = TypeVar("RequestT", bound=SamplingRequest)


def parse_request(raw: bytes, cls: type[RequestT]) -> RequestT:
    """JSON bytes -> validated request, or a 400 naming the offending field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    check_supported(request)
    return request


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
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


def check_supported(request: SamplingRequest) -> None:
    if request.n is not None and request.n > 1:
        raise unsupported("n", "Only n=1 is supported.")
    if request.stream_options is not None and not request.stream:
        raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options")
    stops = stop_strings(request)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(f"At most {MAX_STOP_STRINGS} stop sequences are supported.", "stop")
    if any(s == "" for s in stops):
        raise invalid_request("Stop sequences must be non-empty strings.", "stop")
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request)
    elif isinstance(request, CompletionRequest):
        _check_completion(request)


def _check_chat(request: ChatCompletionRequest) -> None:
    if request.logprobs or request.top_logprobs:
        raise unsupported("logprobs", "logprobs are not supported by this server.")
    if request.tools and request.tool_choice != "none":
        raise unsupported("tools", "Tool calling is not supported by this server.")
    if request.functions:
        raise unsupported("functions", "Function calling is not supported by this server.")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "Only response_format type 'text' is supported.")
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise unsupported(f"messages[{i}].content[{j}]",
                                      f"Only text content parts are supported, got type '{part.type}'.")


def _check_completion(request: CompletionRequest) -> None:
    if request.echo:
        raise unsupported("echo", "echo is not supported by this server.")
    if request.best_of is not None and request.best_of > 1:
        raise unsupported("best_of", "Only best_of=1 is supported.")
    if request.suffix:
        raise unsupported("suffix", "suffix (fill-in-the-middle) is not supported by this server.")
    if request.logprobs:
        raise unsupported("logprobs", "logprobs are not supported by this server.")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
        raise unsupported("prompt", "Only one prompt per request is supported.")
    if prompt == "" or prompt == [] or prompt == [""] or prompt == [[]]:
        raise invalid_request("The prompt must not be empty.", "prompt")


def stop_strings(request: SamplingRequest) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


def max_tokens_of(request: SamplingRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text or "" for part in message.content)
