"""A `POST /v1/responses` body -> a chat completion request over the same engine path.

Fields (OpenAI's Responses API): `model`, `input` (a string, or items: messages with text content,
`function_call`, `function_call_output`, `custom_tool_call`, `custom_tool_call_output`, `item_reference`;
`reasoning` items are skipped), `instructions` (a system message first), `max_output_tokens`, `temperature`,
`top_p`, `tools` (function tools, and custom tools as functions taking one string:
server/responses_api/custom_tools.py; other tool types, such as Codex's `namespace`, `web_search` and
`image_generation`, are left out, each type logged once), `tool_choice`, `parallel_tool_calls`, `text.format`
(text, json_object, json_schema), `stream`, `store`, `previous_response_id`, `metadata`, `user`; our
extras `seed`, `top_k`, `min_p`, `stop`. Unknown fields (`include`, `reasoning`, `prompt_cache_key`,
...) are ignored; `background: true` is a 400.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import APIError, invalid_request, unsupported
from server.json_body import load_json_object
from server.protocol import ChatCompletionRequest, check_supported, error_param
from server.responses_api.custom_tools import call_arguments, custom_function
from server.responses_api.store import MAX_ITEMS

log = logging.getLogger("specexec.server")

Item = dict[str, Any]
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ignored_tool_types: set[str] = set()


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class NamedTool(_Model):
    """A named tool_choice: a function tool's, or a custom tool's (forced as its function is)."""

    type: Literal["function", "custom"]
    name: str


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[Item] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    # extras beyond OpenAI's Responses API (as on chat)
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None

    def function_tools(self) -> list[Item]:
        """The function and custom tools as chat's `{"type": "function", "function": {...}}`; other types
        are left out."""
        out = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") == "custom":
                out.append(custom_function(tool, i))
                continue
            if tool.get("type") != "function":
                _ignore_tool_type(str(tool.get("type")))
                continue
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise invalid_request("A function tool needs a 'name'.", f"tools[{i}].name", "missing_required_parameter")
            out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                              "strict") if tool.get(k) is not None}})
        return out

    def custom_tool_names(self) -> frozenset[str]:
        """The names of the custom tools: the model's calls to them are custom_tool_call items."""
        return frozenset(str(tool.get("name")) for tool in self.tools or [] if tool.get("type") == "custom")

    def response_format(self) -> Item | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _ignore_tool_type(kind: str) -> None:
    """Codex sends tools of types only OpenAI's servers run (web_search, image_generation) or that group
    others (namespace): they are not offered to the model."""
    if kind not in _ignored_tool_types:
        _ignored_tool_types.add(kind)
        log.info("/v1/responses: tools of type %r are left out (only function tools are served)", kind)


FIELDS = {name for cls in (ResponsesRequest, TextConfig, TextFormat, NamedTool) for name in cls.model_fields} | {
    "schema"}


def parse_responses(raw: bytes) -> ResponsesRequest:
    try:
        request = ResponsesRequest.model_validate(load_json_object(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"] if p in FIELDS or
                        isinstance(p, int)).lstrip(".") or "input"
        if first["type"] == "missing":
            raise invalid_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter") from None
        raise invalid_request(f"Invalid value for '{param}': {first['msg']}.", param, "invalid_value") from None
    if request.background:
        raise unsupported("background", "Background responses are not supported by this server.")
    if isinstance(request.input, list) and len(request.input) > MAX_ITEMS:
        raise invalid_request(f"A request may hold at most {MAX_ITEMS} input items, got {len(request.input)}.",
                              "input", "invalid_value")
    return request


def input_items(request: ResponsesRequest) -> list[Item]:
    """The request's own input as items (a string input is one user message)."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return list(request.input)


def chat_request(request: ResponsesRequest, items: list[Item], lookup: Callable[[str], Item | None]) -> ChatCompletionRequest:
    """The chat completion request that serves `request`; `items` is the whole conversation (history
    from previous_response_id first); `lookup` finds a stored item by id (item_reference)."""
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else [])
    messages += chat_messages(items, lookup)
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream,
        "max_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "tools": request.function_tools() or None, "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": request.response_format(), "user": request.user, "seed": request.seed,
        "top_k": request.top_k, "min_p": request.min_p, "stop": request.stop,
    }
    choice = request.tool_choice
    body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedTool) \
        else choice
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        check_supported(chat)
    except ValidationError as exc:
        raise _responses_error(error_param(exc.errors()[0]["loc"]), exc.errors()[0]["msg"]) from None
    except APIError as exc:
        exc.param = _responses_param(exc.param)
        raise
    return chat


def chat_messages(items: list[Item], lookup: Callable[[str], Item | None]) -> list[Item]:
    """Response items -> chat messages: a function_call (or custom_tool_call) joins the assistant message
    before it (or starts one), a function_call_output (or custom_tool_call_output) is a tool message."""
    messages: list[Item] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid_request("Input items must be objects.", f"input[{i}]", "invalid_value")
        if item.get("type") == "item_reference":
            found = lookup(str(item.get("id")))
            if found is None:
                raise invalid_request(f"No stored item with id {item.get('id')!r}.", f"input[{i}].id", "invalid_value")
            item = found
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise invalid_request(f"Unknown role {item.get('role')!r}.", f"input[{i}].role", "invalid_value")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = (item.get("arguments") or "{}") if kind == "function_call" else call_arguments(
                _text(item.get("input"), f"input[{i}].input"))
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":
            raise unsupported(f"input[{i}].type", f"Input items of type {kind!r} are not supported by this server.")
    return messages


def _field(item: Item, name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid_request(f"A {item.get('type')} item needs '{name}'.", f"input[{index}].{name}",
                              "missing_required_parameter")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content (a string, or text parts) as text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS and kind != "refusal":
            raise unsupported(f"{param}[{j}]", f"Only text content is supported, got {kind!r}.")
        texts.append(part.get("text") or part.get("refusal") or "")
    return "".join(texts)


def _responses_param(param: str | None) -> str | None:
    """A chat request's field name -> the Responses field that set it."""
    if param is None:
        return None
    for chat, responses in (("messages", "input"), ("max_tokens", "max_output_tokens"),
                            ("response_format", "text.format"), ("tools", "tools")):
        if param.startswith(chat):
            return responses if chat != "tools" else param.replace(".function", "")
    return param


def _responses_error(param: str, message: str) -> APIError:
    param = _responses_param(param) or param
    return invalid_request(f"Invalid value for '{param}': {message}.", param, "invalid_value")
