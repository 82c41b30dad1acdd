"""Responses input items -> chat messages (the conversation the chat template renders).

Rendered: `message` (role user / assistant / system / developer as system; text parts), `function_call`,
`custom_tool_call` (arguments `{"input": ...}`: server/responses_api/custom_tools.py) and `local_shell_call`
(a call of `local_shell` with its action as arguments) as the calls of an assistant message (joining the
assistant message before them, or starting one), their `*_output` items as tool messages (an `input_image` in
an output, as Codex's view_image sends, is a note in the prompt: server/tool_images.py; an `input_file` its
text or a note naming it: server/tool_files.py), `reasoning` (its
`reasoning_text` content, else its summary) as the `reasoning_content` of the assistant turn it precedes
(templates that render past reasoning, such as Qwen3's, show it; others leave it out; reasoning followed by
no assistant turn is dropped; `encrypted_content` cannot be read here and is ignored), and Codex's
`agent_message` (a message between agents) as a user message naming its author. `additional_tools` items
render nothing: their tools are offered with the request's (`conversation_tools`).

Skipped (history only: what OpenAI's servers ran, or opaque): `web_search_call`, `image_generation_call`,
`tool_search_call` / `_output`, `compaction` (`compaction_summary`), `context_compaction`,
`compaction_trigger`, and any other type, each logged once (as Codex itself keeps unknown types), so a
client replaying the whole history never gets a 400 for an item it did not write.

Invariant: one chat message per rendered turn; a tool message always follows the assistant message that
holds its call when the client sent them in that order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from server.errors import invalid_request, unsupported
from server.responses_api.custom_tools import call_arguments
from server.responses_api.namespaces import call_name
from server.tool_files import responses_file_text
from server.tool_images import image_part

log = logging.getLogger("specexec.server")

Item = dict[str, Any]
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
OPAQUE_PARTS = ("encrypted_content",)  # parts nothing here can read: left out of the text
FILE_INPUT = "input_file"  # in a tool's output: its text or a note (server/tool_files.py); elsewhere a 400
IMAGE_INPUT = "input_image"  # in a tool's output: a note in the prompt (server/tool_images.py); elsewhere a 400
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
CALLS = ("function_call", "custom_tool_call", "local_shell_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
LOCAL_SHELL = "local_shell"  # the name a local_shell_call is rendered under
_skipped_types: set[str] = set()


def chat_messages(items: list[Item], lookup: Callable[[str], Item | None]) -> list[Item]:
    """Response items -> chat messages; `lookup` finds a stored item by id (item_reference)."""
    messages: list[Item] = []
    reasoning: list[str] = []  # the text of reasoning items waiting for the assistant turn they precede
    for i, item in enumerate(items):
        item = _resolved(item, i, lookup)
        kind = item.get("type", "message")
        if kind == "reasoning":
            if text := reasoning_text(item):
                reasoning.append(text)
        elif kind == "message":
            message = {"role": _role(item, i), "content": _text(item.get("content"), f"input[{i}].content")}
            if message["role"] == "assistant":
                _add_reasoning(message, reasoning)
            reasoning.clear()  # reasoning before a turn of another role has no place in the prompt
            messages.append(message)
        elif kind in CALLS:
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            _add_reasoning(last, reasoning)
            last.setdefault("tool_calls", []).append(_call(item, kind, i))
        elif kind in OUTPUTS:
            reasoning.clear()
            messages.append({"role": "tool", "tool_call_id": _output_call_id(item, kind, i),
                             "content": _output(item.get("output"), f"input[{i}].output")})
        elif kind == "agent_message":
            reasoning.clear()
            messages.append({"role": "user", "content": _agent_text(item, i)})
        elif kind != "additional_tools":
            _skip(str(kind))
    return messages


def conversation_tools(items: list[Item]) -> list[Item]:
    """The tools of the conversation's `additional_tools` items (Codex sends its tools so in some modes)."""
    tools: list[Item] = []
    for item in items:
        if isinstance(item, dict) and item.get("type") == "additional_tools" and isinstance(item.get("tools"), list):
            tools += [tool for tool in item["tools"] if isinstance(tool, dict)]
    return tools


def reasoning_text(item: Item) -> str:
    """A reasoning item's text: its `reasoning_text` (or `text`) content, else its summary; "" when it has
    only `encrypted_content`."""
    for name in ("content", "summary"):
        parts = item.get(name)
        if isinstance(parts, list):
            texts = [part["text"] for part in parts if isinstance(part, dict) and isinstance(part.get("text"), str)]
            if any(texts):
                return "\n\n".join(text for text in texts if text)
    return ""


def _resolved(item: Any, index: int, lookup: Callable[[str], Item | None]) -> Item:
    if not isinstance(item, dict):
        raise invalid_request("Input items must be objects.", f"input[{index}]", "invalid_value")
    if item.get("type") == "item_reference":
        found = lookup(str(item.get("id")))
        if found is None:
            raise invalid_request(f"No stored item with id {item.get('id')!r}.", f"input[{index}].id", "invalid_value")
        item = found
    if not isinstance(item.get("type", "message"), str):
        raise invalid_request("An input item's 'type' is a string.", f"input[{index}].type", "invalid_value")
    return item


def _role(item: Item, index: int) -> str:
    role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise invalid_request(f"Unknown role {item.get('role')!r}.", f"input[{index}].role", "invalid_value")
    return role


def _add_reasoning(message: Item, reasoning: list[str]) -> None:
    """Give the waiting reasoning to an assistant message (after what it already holds)."""
    if not reasoning:
        return
    held = message.get("reasoning_content")
    message["reasoning_content"] = "\n\n".join(([held] if held else []) + reasoning)
    reasoning.clear()


def _call(item: Item, kind: str, index: int) -> Item:
    if kind == "local_shell_call":
        action = item.get("action") if isinstance(item.get("action"), dict) else {}
        arguments = json.dumps({k: v for k, v in action.items() if k != "type" and v is not None}, ensure_ascii=False)
        call_id = item.get("call_id") or item.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid_request("A local_shell_call item needs 'call_id'.", f"input[{index}].call_id",
                                  "missing_required_parameter")
        return {"id": call_id, "type": "function", "function": {"name": LOCAL_SHELL, "arguments": arguments}}
    if kind == "function_call":
        arguments = item.get("arguments") or "{}"
    else:
        arguments = call_arguments(_text(item.get("input"), f"input[{index}].input"))
    name = call_name(_field(item, "name", index), item.get("namespace"))  # qualified in a namespace
    return {"id": _field(item, "call_id", index), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _output_call_id(item: Item, kind: str, index: int) -> str:
    if kind == "local_shell_call_output" and not item.get("call_id") and isinstance(item.get("id"), str):
        return item["id"]  # OpenAI's local_shell_call_output names its call by `id`
    return _field(item, "call_id", index)


def _agent_text(item: Item, index: int) -> str:
    text = _text(item.get("content"), f"input[{index}].content")
    author, recipient = item.get("author"), item.get("recipient")
    if isinstance(author, str) and author:
        to = f" to {recipient}" if isinstance(recipient, str) and recipient else ""
        return f"Message from {author}{to}:\n{text}"
    return text


def _skip(kind: str) -> None:
    if kind not in _skipped_types:
        _skipped_types.add(kind)
        log.info("/v1/responses: input items of type %r are skipped (history this server cannot render)", kind)


def _field(item: Item, name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid_request(f"A {item.get('type')} item needs '{name}'.", f"input[{index}].{name}",
                              "missing_required_parameter")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content (a string, or text parts) as text; opaque parts (`encrypted_content`) are left out."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False)
    return "".join(_part_text(part, f"{param}[{j}]") for j, part in enumerate(content))


def _output(content: Any, param: str) -> str | list[Item]:
    """A tool's output: as `_text`, or with images (Codex's view_image: `input_image` parts) chat parts, an
    image part in each image's place (server/tool_images.py), the text between images one text part."""
    if isinstance(content, list):  # a file's text, or a note naming it (server/tool_files.py)
        content = [{"type": "input_text", "text": responses_file_text(part)}
                   if isinstance(part, dict) and part.get("type") == FILE_INPUT else part for part in content]
    if not isinstance(content, list) or not any(_is_image(part) for part in content):
        return _text(content, param)
    parts: list[Item] = []
    for j, part in enumerate(content):
        if _is_image(part):
            parts.append(image_part())
        elif parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += _part_text(part, f"{param}[{j}]")
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{param}[{j}]")})
    return parts


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_INPUT


def _part_text(part: Any, param: str) -> str:
    """A text part's text; "" for an opaque part; any other part is a 400 naming it."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in OPAQUE_PARTS:
        return ""
    if kind not in TEXT_PARTS and kind != "refusal":
        raise unsupported(param, f"Only text content is supported, got {kind!r}.")
    return part.get("text") or part.get("refusal") or ""
