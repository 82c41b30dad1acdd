"""A `POST /v1/responses` body -> a chat completion request over the same engine path.

Fields (OpenAI's Responses API): `model`, `input` (a string, or items: server/responses_api/items.py),
`instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, `tools` (function
tools, and custom tools as functions taking one string: server/responses_api/custom_tools.py; with the
tools of `additional_tools` input items; the function and custom tools of `namespace` tools under qualified
names: server/responses_api/namespaces.py; other tool types, such as `web_search` and `image_generation`,
are left out, each type logged once), `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema; `text.verbosity` ignored), `reasoning` (`effort` as template
variables, `REASONING_EFFORT`; `summary` ignored), `stream`, `store`, `previous_response_id`, `metadata`,
`user`; our extras `seed`, `top_k`, `min_p`, `stop`, `chat_template_kwargs`. Unknown fields (`include`,
`prompt_cache_key`, `service_tier`, `client_metadata`, ...) are ignored; `background: true` is a 400.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import APIError, invalid_request, unsupported
from server.json_body import load_json_object
from server.protocol import ChatCompletionRequest, check_supported, error_param
from server.responses_api.custom_tools import custom_function
from server.responses_api.items import chat_messages, conversation_tools
from server.responses_api.namespaces import call_name
from server.responses_api.store import MAX_ITEMS

log = logging.getLogger("specexec.server")

Item = dict[str, Any]
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


# `reasoning.effort` -> chat template variables: "none" and "minimal" ask the template not to think
# (Qwen3, SmolLM3, GLM read `enable_thinking`); the others ask it to, and name the level as GPT-OSS's
# template reads it (`reasoning_effort`: low, medium or high). A template without these variables ignores them.
REASONING_EFFORT: dict[str, dict[str, Any]] = {
    "none": {"enable_thinking": False}, "minimal": {"enable_thinking": False},
    "low": {"enable_thinking": True, "reasoning_effort": "low"},
    "medium": {"enable_thinking": True, "reasoning_effort": "medium"},
    "high": {"enable_thinking": True, "reasoning_effort": "high"},
    "xhigh": {"enable_thinking": True, "reasoning_effort": "high"},
    "max": {"enable_thinking": True, "reasoning_effort": "high"},
}


class ReasoningConfig(_Model):
    """`reasoning`: `effort` (REASONING_EFFORT); `summary` ("auto", "concise", "detailed", "none") is
    accepted and ignored: the reasoning comes back whole, as `reasoning_text` content."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class NamedTool(_Model):
    """A named tool_choice: a function tool's, or a custom tool's (forced as its function is)."""

    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None  # a tool of a namespace tool (server/responses_api/namespaces.py)


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
    reasoning: ReasoningConfig | None = None
    # extras beyond OpenAI's Responses API (as on chat)
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat: extra template variables

    def offered_tools(self, items: list[Item]) -> list[Item]:
        """The request's tools, then those of the conversation's `additional_tools` items whose names are
        new (Responses tool objects, all types)."""
        tools = list(self.tools or [])
        names = {tool.get("name") for tool in tools}
        for tool in conversation_tools(items):
            if tool.get("name") is None or tool.get("name") not in names:
                names.add(tool.get("name"))
                tools.append(tool)
        return tools

    def template_kwargs(self) -> dict[str, Any] | None:
        """Chat template variables: those `reasoning.effort` implies, then `chat_template_kwargs`."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        kwargs = REASONING_EFFORT.get(effort, {}) | (self.chat_template_kwargs or {})  # type: ignore[arg-type]
        return kwargs or None

    def response_format(self) -> Item | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def function_tools(tools: list[Item]) -> list[Item]:
    """Function and custom tools as chat's `{"type": "function", "function": {...}}`; other types are left out."""
    out = []
    for i, tool in enumerate(tools):
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


def custom_tool_names(flat_tools: list[Item]) -> frozenset[str]:
    """The names the custom tools of `flat_tools` (namespaces flattened: namespaces.flatten) are offered
    under: the model's calls to them are custom_tool_call items."""
    return frozenset(str(tool.get("name")) for tool in flat_tools if tool.get("type") == "custom")


def _ignore_tool_type(kind: str) -> None:
    """Codex sends tools of types only OpenAI's servers run (web_search, image_generation): they are not
    offered to the model."""
    if kind not in _ignored_tool_types:
        _ignored_tool_types.add(kind)
        log.info("/v1/responses: tools of type %r are left out (only function tools are served)", kind)


FIELDS = {name for cls in (ResponsesRequest, TextConfig, TextFormat, NamedTool, ReasoningConfig)
          for name in cls.model_fields} | {
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


def chat_request(request: ResponsesRequest, items: list[Item], lookup: Callable[[str], Item | None],
                 tools: list[Item]) -> ChatCompletionRequest:
    """The chat completion request that serves `request`; `items` is the whole conversation (history
    from previous_response_id first); `lookup` finds a stored item by id (item_reference); `tools`: the
    tools offered (`request.offered_tools(items)`), namespaces flattened (namespaces.flatten)."""
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else [])
    messages += chat_messages(items, lookup)
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream,
        "max_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "tools": function_tools(tools) or None, "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": request.response_format(), "user": request.user, "seed": request.seed,
        "top_k": request.top_k, "min_p": request.min_p, "stop": request.stop,
        "chat_template_kwargs": request.template_kwargs(),
    }
    choice = request.tool_choice
    body["tool_choice"] = {"type": "function", "function": {"name": call_name(choice.name, choice.namespace)}} \
        if isinstance(choice, NamedTool) else choice
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        check_supported(chat)
    except ValidationError as exc:
        raise _responses_error(error_param(exc.errors()[0]["loc"]), exc.errors()[0]["msg"]) from None
    except APIError as exc:
        exc.param = _responses_param(exc.param)
        raise
    return chat


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
