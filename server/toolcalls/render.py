"""OpenAI chat messages and tools -> what chat templates expect (transformers' conventions).

Templates read a past call's `arguments` as an object (`tool_call.arguments | tojson`), so the
JSON string OpenAI clients send is parsed back; Mistral's templates accept only 9-character
alphanumeric call ids, so other ids are mapped, the same way in a call and in its result. Qwen's
XML templates print arguments per key (`arguments|items`): there, arguments that are no object are a 400.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from server.errors import invalid_request
from server.protocol import ChatMessage, ToolCall, ToolDefinition, message_text
from server.toolcalls.parsers import ToolFormat

MISTRAL_ID_LEN = 9


def conversation(messages: list[ChatMessage], fmt: ToolFormat | None) -> list[dict[str, Any]]:
    short_ids = fmt is not None and fmt.name == "mistral"
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message_text(message)}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_call(call, short_ids) for call in message.tool_calls]
            if fmt is not None and fmt.xml:
                _check_objects(entry["tool_calls"], i)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = mistral_id(message.tool_call_id) if short_ids else message.tool_call_id
        out.append(entry)
    return out


def tool_schemas(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _call(call: ToolCall, short_ids: bool) -> dict[str, Any]:
    call_id = call.id or ""
    return {
        "id": mistral_id(call_id) if short_ids else call_id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments_object(call.function.arguments)},
    }


def _check_objects(calls: list[dict[str, Any]], i: int) -> None:
    """The XML format's templates print a past call's arguments one `<parameter=k>` per key
    (`arguments|items`): arguments that are no JSON object are a 400, not a template failure."""
    for j, call in enumerate(calls):
        if not isinstance(call["function"]["arguments"], dict):
            raise invalid_request(f"The arguments of a past tool call must be a JSON object: this model's chat "
                                  f"template prints them one parameter per key (got {call['function']['arguments']!r:.80}).",
                                  f"messages[{i}].tool_calls[{j}].function.arguments", "invalid_value")


def arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """A call's arguments as the object templates print; text that is no JSON object stays text."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def mistral_id(call_id: str) -> str:
    if len(call_id) == MISTRAL_ID_LEN and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:MISTRAL_ID_LEN]
