"""`/api/chat` and `/api/generate` bodies -> chat / completion requests over the same engine path.

- `/api/chat`: `messages` (`role` system / user / assistant / tool, `content`, `tool_calls` with
  `function.arguments` an object, `tool_name` and `tool_call_id` on tool results; an assistant's
  `thinking` as its `reasoning_content`, for templates that render it; harmony templates as `thinking`: server/harmony_output.py), `tools` (function tools, as
  OpenAI's), `format`, `options`: a chat completion request.
- `think` (chat, and generate through the template): `true`, or a level `"low"` / `"medium"` / `"high"`
  (GPT-OSS), asks the template to think (`enable_thinking: true`; a level also as `reasoning_effort`)
  and the reply's reasoning comes apart (`thinking`); `false` asks it not to (`enable_thinking: false`:
  Qwen3, SmolLM3, GLM templates) and the reply has no `thinking` (reasoning written anyway is dropped);
  left out: the template's default, reasoning apart as with `true`. Templates without these variables
  ignore them. Other values are a 400.
- `/api/generate`: `prompt` with `system` through the chat template (a system and a user message);
  with `raw: true` the prompt as is (a text completion, as /v1/completions); with `suffix`
  fill-in-the-middle (as /v1/completions with `suffix`).
- `format`: `"json"` (any JSON object) or a JSON schema, under the grammar (as `response_format`).
- `options`: `num_predict` (absent or 0: the server's default max tokens; -1 or -2: until the context
  is full), `temperature`, `top_k`, `top_p`, `min_p`, `stop`, `seed` (negative: random),
  `repeat_penalty`, `presence_penalty`, `frequency_penalty`; `num_ctx` is accepted (the context is the
  server's, --max-context); `typical_p` other than 1 and `mirostat` other than 0 are 400s (not
  implemented); the loading options (`num_gpu`, `num_thread`, `num_batch`, `use_mmap`, ...) are ignored.
- Accepted and ignored: `keep_alive` (the model stays loaded), `truncate`, `shift`. Images (but a `tool` message's: notes,
  server/tool_images.py), `template`, `context` and `logprobs` are 400s.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.types import REPETITION_PENALTY_RANGE
from server.errors import invalid_request, unsupported
from server.json_body import load_json_object
from server.protocol import ChatCompletionRequest, CompletionRequest, validated_as
from server.tool_images import image_part

FILL_CONTEXT = (-1, -2)  # num_predict: generate until the context is full
THINK_LEVELS = ("low", "medium", "high")  # `think` as a string (GPT-OSS's reasoning levels)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Options(_Model):
    num_predict: int | None = Field(None, ge=-2)
    temperature: float | None = Field(None, ge=0, le=2)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    num_ctx: int | None = Field(None, ge=1)
    repeat_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    typical_p: float | None = None
    mirostat: int | None = None


class FunctionCall(_Model):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Model):
    id: str | None = None
    function: FunctionCall


class Message(_Model):
    role: str
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


class OllamaRequest(_Model):
    """What /api/chat and /api/generate share."""

    model: str | None = None
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool | None = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None


class ChatRequest(OllamaRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Any] | None = None


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = False
    images: list[Any] | None = None


FIELDS = {name for cls in (ChatRequest, GenerateRequest, Options, Message, ToolCall, FunctionCall)
          for name in cls.model_fields}
CHAT_PARAMS = {"max_tokens": "options.num_predict", "stop": "options.stop", "temperature": "options.temperature",
               "top_k": "options.top_k", "top_p": "options.top_p", "min_p": "options.min_p",
               "repetition_penalty": "options.repeat_penalty", "response_format": "format", "seed": "options.seed"}


def parse_ollama(raw: bytes, cls: type[ChatRequest] | type[GenerateRequest]) -> Any:
    try:
        request = cls.model_validate(load_json_object(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]
                        if p in FIELDS or isinstance(p, int)).lstrip(".") or "body"
        if first["type"] == "missing":
            raise invalid_request(f"missing required field '{param}'", param, "missing_required_parameter") from None
        raise invalid_request(f"invalid value for '{param}': {first['msg']}", param, "invalid_value") from None
    _check_common(request)
    return request


def _check_common(request: OllamaRequest) -> None:
    options = request.options or Options()
    if options.typical_p is not None and options.typical_p != 1.0:
        raise unsupported("options.typical_p", "options.typical_p is not supported by this server (use 1.0).")
    if options.mirostat:
        raise unsupported("options.mirostat", "options.mirostat is not supported by this server (use 0).")
    if request.logprobs:
        raise unsupported("logprobs", "logprobs are not supported on /api/chat and /api/generate here; "
                                      "/v1/chat/completions has them.")
    if isinstance(request.think, str) and request.think not in THINK_LEVELS:
        raise invalid_request(f"invalid value for 'think': {request.think!r} (use true, false, \"low\", \"medium\" "
                              "or \"high\")", "think", "invalid_value")


def think_kwargs(think: bool | str | None) -> dict[str, Any] | None:
    """`think` as chat template variables (None: left out, the template's default)."""
    if think is None:
        return None
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def chat_request(request: ChatRequest, max_context: int) -> ChatCompletionRequest:
    messages = [_chat_message(message, i) for i, message in enumerate(request.messages)]
    return _validated(ChatCompletionRequest, {"messages": messages, "tools": request.tools,
                                              "chat_template_kwargs": think_kwargs(request.think)}, request, max_context)


def generate_request(request: GenerateRequest, max_context: int) -> ChatCompletionRequest | CompletionRequest:
    if request.images:
        raise unsupported("images", "Images are not supported by this server.")
    if request.template:
        raise unsupported("template", "'template' is not supported: the model's chat template is used, or none "
                                      "with raw: true.")
    if request.context:
        raise unsupported("context", "'context' (token ids of an earlier /api/generate) is not supported; send "
                                     "the conversation to /api/chat instead.")
    if request.raw or request.suffix:
        fields: dict[str, Any] = {"prompt": request.prompt}
        if request.suffix:
            fields["suffix"] = request.suffix
        return _validated(CompletionRequest, fields, request, max_context)
    messages = ([{"role": "system", "content": request.system}] if request.system else [])
    messages.append({"role": "user", "content": request.prompt})
    return _validated(ChatCompletionRequest, {"messages": messages, "chat_template_kwargs": think_kwargs(request.think)},
                      request, max_context)


def _chat_message(message: Message, index: int) -> dict[str, Any]:
    role = message.role.lower()
    if message.images and role != "tool":  # a tool's images are notes (server/tool_images.py)
        raise unsupported(f"messages[{index}].images", "Images are not supported by this server.")
    out: dict[str, Any] = {"role": role, "content": message.content or ""}
    if message.images:
        text = [{"type": "text", "text": out["content"]}] if out["content"] else []
        out["content"] = text + [image_part() for _ in message.images]
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id or f"call_{index}_{j}", "type": "function",
                              "function": {"name": call.function.name, "arguments": call.function.arguments}}
                             for j, call in enumerate(message.tool_calls)]
    if message.tool_name:
        out["name"] = message.tool_name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.thinking and out["role"] == "assistant":
        out["reasoning_content"] = message.thinking
    return out


def _validated(cls: type[Any], fields: dict[str, Any], request: OllamaRequest, max_context: int) -> Any:
    body = {"model": request.model, **fields, **_sampling(request.options or Options(), max_context),
            "response_format": _response_format(request.format)}
    return validated_as(cls, body, _ollama_param, "invalid value for '{param}': {msg}")


def _sampling(options: Options, max_context: int) -> dict[str, Any]:
    max_tokens = options.num_predict or None  # 0: the default
    if max_tokens in FILL_CONTEXT:
        max_tokens = max_context  # cut to the room the prompt leaves (server/prompt.py)
    return {"max_tokens": max_tokens, "temperature": options.temperature, "top_k": options.top_k,
            "top_p": options.top_p, "min_p": options.min_p, "stop": options.stop,
            "seed": options.seed if options.seed is not None and options.seed >= 0 else None,
            "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
            "frequency_penalty": options.frequency_penalty}


def _response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise invalid_request(f"invalid value for 'format': {json.dumps(fmt)} (use \"json\" or a JSON schema)", "format")


def _ollama_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ollama in CHAT_PARAMS.items():
        if param == chat or param.startswith(chat + "."):
            return ollama
    return param
