"""A `POST /v1/messages` body -> a chat completion request over the same engine path.

Fields (Anthropic's Messages API): `model`, `max_tokens`, `messages` (user and assistant turns whose
content is a string or blocks: `text`, `tool_use` (assistant), `tool_result` (user); `thinking` blocks
of past turns become the turn's `reasoning_content` (only harmony templates read it:
server/harmony_output.py), `redacted_thinking` blocks are skipped; an `image` in a `tool_result` is a note
in the prompt (server/tool_images.py), a `document` in a `tool_result` its text or a note naming it, a
user's `document` its text where its source is text (server/tool_files.py); other images and documents
are 400s), `system` (a
string or text blocks), `stop_sequences`, `temperature` (0..1), `top_p`, `top_k`, `tools` (custom
tools: `name`, `description`, `input_schema`), `tool_choice` (`auto`, `any`, `tool` with `name`,
`none`; `disable_parallel_tool_use`), `stream`, `metadata`, `thinking`; our extras `seed`, `min_p`.
Unknown fields are ignored (Claude Code's `context_management`, `output_config`, `cache_control` on
blocks). `thinking` sets the template's `enable_thinking` and `reasoning_effort` (thinking_kwargs); replies
have thinking blocks when the model reasons.

Normalised here, so the prompt of a conversation is the same from turn to turn (the prefix cache):
- Claude Code's `x-anthropic-billing-header: ...` system block, which changes on every request, is dropped;
- a `system` turn inside `messages` (Claude Code sends one) is appended to the user turn right before
  it (else it stays a system message where it is), since many chat templates allow a system message
  only first;
- tools of Anthropic's server and built-in types (`web_search_...`, `bash_...`, `text_editor_...`)
  and tools with `defer_loading: true` are left out (each type logged once): only custom tools, with
  their schemas, can be rendered and called.
A final assistant turn (a prefill) is a 400: replies always start a new assistant turn.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import APIError, invalid_request, unsupported
from server.json_body import load_json_object
from server.protocol import ChatCompletionRequest, validated_as
from server.tool_files import anthropic_document_note, anthropic_document_text
from server.tool_images import image_part

log = logging.getLogger("specexec.server")

BILLING_HEADER = "x-anthropic-billing-header:"
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # past reasoning: not part of the prompt
CUSTOM_TOOL_TYPES = (None, "custom")
Block = dict[str, Any]
Message = dict[str, Any]
_ignored_tool_types: set[str] = set()


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Model):
    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)  # None: the server's default
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[Any] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # extras beyond Anthropic's API (as on chat)
    seed: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)


FIELDS = {name for cls in (MessagesRequest, ToolChoice) for name in cls.model_fields}
CHAT_PARAMS = (("stop", "stop_sequences"), ("tool_choice", "tool_choice"), ("tools", "tools"),
               ("messages", "messages"), ("max_tokens", "max_tokens"), ("response_format", "messages"))


def parse_messages(raw: bytes) -> MessagesRequest:
    try:
        return MessagesRequest.model_validate(load_json_object(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]
                        if p in FIELDS or isinstance(p, int)).lstrip(".") or "messages"
        if first["type"] == "missing":
            raise invalid_request(f"{param}: Field required", param, "missing_required_parameter") from None
        raise invalid_request(f"{param}: {first['msg']}", param, "invalid_value") from None


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `request` (same template, tools, grammar, sampling)."""
    system = system_parts(request.system)
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages += chat_messages(request.messages)
    tools = chat_tools(request.tools or [])
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_tokens": request.max_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
        "stop": request.stop_sequences, "stream": request.stream, "tools": tools or None,
        "seed": request.seed, "min_p": request.min_p, "chat_template_kwargs": thinking_kwargs(request.thinking),
    }
    if (choice := request.tool_choice) is not None:
        body["tool_choice"] = _tool_choice(choice)
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return validated_as(ChatCompletionRequest, body, _anthropic_param)


# Anthropic's `thinking.budget_tokens` -> `reasoning_effort` (GPT-OSS reads it): below 4096 low, below
# 16384 medium, else high (Claude Code's "think", "think hard" and "ultrathink" ask 4000, 10000 and 31999)
EFFORT_BUDGETS = ((4096, "low"), (16384, "medium"))


def thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` as chat template variables, as Ollama's `think` and Responses' `reasoning.effort` are:
    `{"type": "enabled", "budget_tokens": n}` -> enable_thinking and a reasoning_effort from n;
    `{"type": "disabled"}` -> enable_thinking false; `adaptive` (the model decides: what Claude Code sends
    unless thinking is toggled), None or another type: none, so the template's default or the server's
    --chat-template-kwargs decide. (`output_config.effort`, which Claude Code sends as "high" on every
    request, is not read.)"""
    kind = (thinking or {}).get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind != "enabled":
        return None
    budget = thinking.get("budget_tokens") if thinking else None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise invalid_request("'thinking.budget_tokens' must be a positive integer.", "thinking.budget_tokens")
    effort = next((level for limit, level in EFFORT_BUDGETS if budget < limit), "high")
    return {"enable_thinking": True, "reasoning_effort": effort}


def system_parts(system: str | list[Any] | None) -> list[Block]:
    """The system prompt as text parts, without Claude Code's billing header."""
    if system is None:
        return []
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    parts = []
    for i, block in enumerate(blocks):
        param = f"system[{i}]" if isinstance(system, list) else "system"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid_request("System blocks must be text blocks: {\"type\": \"text\", \"text\": ...}.", param)
        text = without_billing_header(block["text"])
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def without_billing_header(text: str) -> str:
    """`text` without a leading `x-anthropic-billing-header: ...` line (it changes on every request)."""
    if not text.startswith(BILLING_HEADER):
        return text
    _, _, rest = text.partition("\n")
    return rest


def chat_messages(messages: list[Any]) -> list[Message]:
    out: list[Message] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_request("Each message must be an object with 'role' and 'content'.", param)
        role = message.get("role")
        blocks = _blocks(message.get("content"), f"{param}.content")
        if role == "user":
            out += _user_turn(blocks, param)
        elif role == "assistant":
            if i == len(messages) - 1:
                raise unsupported(param, "A final assistant message (prefilling the reply) is not supported by this "
                                         "server: the reply always starts a new assistant turn.")
            out.append(_assistant_turn(blocks, param))
        elif role == "system":
            _system_turn(out, blocks, param)
        else:
            raise invalid_request(f"{param}.role: Input should be 'user' or 'assistant', got {role!r}.", f"{param}.role")
    return out


def _blocks(content: Any, param: str) -> list[Block]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise invalid_request(f"{param}: must be a string or a non-empty list of content blocks.", param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid_request(f"{param}[{j}]: a content block must be an object with a 'type'.", f"{param}[{j}]")
    return content


def _text(block: Block, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid_request(f"{param}.text: Field required (a string).", f"{param}.text", "missing_required_parameter")
    return text


def _not_supported(block: Block, param: str) -> APIError:
    return unsupported(param, f"Content blocks of type {block['type']!r} are not supported by this server here "
                              "(text, tool_use and tool_result are).")


def _user_turn(blocks: list[Block], param: str) -> list[Message]:
    """Tool results (as tool messages, first) and the turn's text (one user message)."""
    results: list[Message] = []
    parts: list[Block] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        if block["type"] == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif block["type"] == "tool_result":
            results.append(_tool_result(block, where))
        elif block["type"] == "document":  # a text source is its text; a PDF would be answered from nothing
            text = anthropic_document_text(block)
            if text is None:
                raise unsupported(where, "Document blocks are supported with text sources only here (this server "
                                         "reads no PDF files); in a tool_result any document is taken.")
            parts.append({"type": "text", "text": text})
        elif block["type"] not in SKIPPED_BLOCKS:
            raise _not_supported(block, where)
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _tool_result(block: Block, param: str) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_request(f"{param}.tool_use_id: Field required.", f"{param}.tool_use_id", "missing_required_parameter")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return {"role": "tool", "tool_call_id": call_id, "content": content or ""}
    parts: list[Block] = []
    for k, part in enumerate(_blocks(content, f"{param}.content")):
        if part["type"] == "image":  # Claude Code's Read of an image file: a note (server/tool_images.py)
            parts.append(image_part())
        elif part["type"] == "text":
            parts.append({"type": "text", "text": _text(part, f"{param}.content[{k}]")})
        elif part["type"] == "document":  # Claude Code's Read of a PDF, an MCP text resource (server/tool_files.py)
            text = anthropic_document_text(part)
            parts.append({"type": "text", "text": anthropic_document_note(part) if text is None else text})
        else:
            raise _not_supported(part, f"{param}.content[{k}]")
    if any(part["type"] != "text" for part in parts):
        return {"role": "tool", "tool_call_id": call_id, "content": parts}
    return {"role": "tool", "tool_call_id": call_id, "content": "\n".join(part["text"] for part in parts)}


def _assistant_turn(blocks: list[Block], param: str) -> Message:
    parts: list[Block] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        if block["type"] == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif block["type"] == "tool_use":
            calls.append(_tool_use(block, where))
        elif block["type"] == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif block["type"] not in SKIPPED_BLOCKS:
            raise _not_supported(block, where)
    message: Message = {"role": "assistant", "content": parts or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n\n".join(thinking)
    return message


def _tool_use(block: Block, param: str) -> dict[str, Any]:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise invalid_request(f"{param}.name: Field required.", f"{param}.name", "missing_required_parameter")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_request(f"{param}.id: Field required.", f"{param}.id", "missing_required_parameter")
    if not isinstance(arguments, dict):
        raise invalid_request(f"{param}.input: must be an object.", f"{param}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _system_turn(out: list[Message], blocks: list[Block], param: str) -> None:
    parts = []
    for j, block in enumerate(blocks):
        if block["type"] != "text":
            raise _not_supported(block, f"{param}.content[{j}]")
        parts.append({"type": "text", "text": _text(block, f"{param}.content[{j}]")})
    last = out[-1] if out else None
    if last is not None and last["role"] == "user":
        last["content"] = last["content"] + parts
    else:
        out.append({"role": "system", "content": parts})


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Custom tools as chat's function tools; other tool types and deferred tools are left out."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid_request(f"tools[{i}]: a tool must be an object.", f"tools[{i}]")
        kind = tool.get("type")
        if kind not in CUSTOM_TOOL_TYPES:
            _ignore_tool_type(str(kind))
            continue
        if tool.get("defer_loading") is True:
            _ignore_tool_type("deferred (defer_loading: true)")
            continue
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"tools[{i}].name: Field required.", f"tools[{i}].name", "missing_required_parameter")
        if not isinstance(schema, dict):
            raise invalid_request(f"tools[{i}].input_schema: Field required (a JSON schema object).",
                                  f"tools[{i}].input_schema", "missing_required_parameter")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(description, str):
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _ignore_tool_type(kind: str) -> None:
    if kind not in _ignored_tool_types:
        _ignored_tool_types.add(kind)
        log.info("/v1/messages: tools of type %s are left out (only custom tools with an input_schema are served)",
                 kind)


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if not choice.name:
            raise invalid_request("tool_choice.name: Field required for tool_choice type 'tool'.", "tool_choice.name",
                                  "missing_required_parameter")
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type


def _anthropic_param(param: str | None) -> str | None:
    """A chat request's field name -> the Messages field that set it."""
    if param is None:
        return None
    for chat, messages in CHAT_PARAMS:
        if param.startswith(chat):
            return messages + param[len(chat):] if chat == messages else messages
    return param
