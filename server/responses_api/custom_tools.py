"""Custom (freeform) tools of the Responses API, such as Codex's `apply_patch`, over chat's function tools.

A tool `{"type": "custom", "name", "description", "format"}` takes a raw string instead of JSON arguments.
It is offered to the model as a function tool with one string argument, `input` (the description kept;
a `format` grammar, lark or regex, is shown to the model in the argument's description but not compiled
or enforced: the string is free text). A call the model makes to it is a `custom_tool_call` output item
whose `input` is that argument; `InputReader` decodes it from the call's arguments as they stream, so
`response.custom_tool_call_input.delta` events carry the string itself, not JSON text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.errors import invalid_request

ARGUMENT = "input"
_HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')  # the arguments' text up to the string's first character
_ESCAPE_LEN = {"u": 6}  # a JSON escape's length by its letter (others: 2)


def custom_function(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A custom tool as chat's `{"type": "function", "function": {...}}` taking `{"input": <string>}`."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_request("A custom tool needs a 'name'.", f"tools[{index}].name", "missing_required_parameter")
    fmt = tool.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar")):
        raise invalid_request("A custom tool's 'format' is {\"type\": \"text\"} or {\"type\": \"grammar\", ...}.",
                              f"tools[{index}].format", "invalid_value")
    argument = {"type": "string", "description": _argument_description(fmt)}
    function = {"name": name, "parameters": {"type": "object", "properties": {ARGUMENT: argument},
                                             "required": [ARGUMENT], "additionalProperties": False}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _argument_description(fmt: dict[str, Any] | None) -> str:
    if fmt is None or fmt.get("type") == "text" or not isinstance(fmt.get("definition"), str):
        return "The tool's input, as raw text."
    return (f"The tool's input, as raw text in this {fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}")


def call_arguments(text: str) -> str:
    """A custom tool call's input as the arguments of the function call the model sees."""
    return json.dumps({ARGUMENT: text}, ensure_ascii=False)


def call_input(arguments: str) -> str | None:
    """The input of a whole call's arguments; None when they hold no string `input` (cut off, or not
    written under the call grammar)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value.get(ARGUMENT) if isinstance(value, dict) and isinstance(value.get(ARGUMENT), str) else None


class InputReader:
    """The `input` string of a call's arguments, decoded as their JSON text streams in: `feed` returns the
    characters of the string that each fragment completes (an escape split across fragments waits for
    its end). Arguments shaped otherwise than `{"input": "...` give nothing: `finish` settles them."""

    def __init__(self) -> None:
        self._raw = ""  # arguments text not decoded yet
        self._state = "head"  # head -> string -> end; "other" when the arguments are shaped otherwise
        self.text = ""  # the input decoded so far

    def feed(self, fragment: str) -> str:
        self._raw += fragment
        if self._state == "head":
            match = _HEAD.match(self._raw)
            if match is None:
                self._state = "head" if _may_become_head(self._raw) else "other"
                return ""
            self._raw, self._state = self._raw[match.end():], "string"
        if self._state != "string":
            return ""
        piece = self._decode()
        self.text += piece
        return piece

    def finish(self, arguments: str) -> str:
        """The whole input, given the call's whole arguments (what `feed` returned is a prefix of it): the
        string decoded so far when they were cut off inside it, the arguments' text itself when they are
        shaped otherwise (what the model wrote is never lost)."""
        whole = call_input(arguments)
        if whole is not None:
            return whole
        return self.text if self._state in ("string", "end") else arguments

    def _decode(self) -> str:
        out: list[str] = []
        i, raw = 0, self._raw
        while i < len(raw):
            ch = raw[i]
            if ch == '"':
                self._state = "end"
                i = len(raw)
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            end = _escape_end(raw, i)
            if end is None:
                break
            out.append(json.loads(f'"{raw[i:end]}"'))
            i = end
        self._raw = raw[i:]
        return "".join(out)


def _escape_end(raw: str, start: int) -> int | None:
    """The end of the escape at raw[start] (a surrogate pair is one), None when it is not all there."""
    if start + 1 >= len(raw):
        return None
    end = start + _ESCAPE_LEN.get(raw[start + 1], 2)
    if end > len(raw):
        return None
    if raw[start + 1] == "u" and 0xD800 <= int(raw[start + 2:end], 16) <= 0xDBFF:  # a high surrogate
        if raw[end:end + 2] != "\\u":
            return None if len(raw) < end + 2 else end
        return end + 6 if end + 6 <= len(raw) else None
    return end


def _may_become_head(raw: str) -> bool:
    """Whether more text could still make `raw` match _HEAD."""
    stripped = raw.lstrip()
    if not stripped:
        return True
    if stripped[0] != "{":
        return False
    rest = stripped[1:].lstrip()
    target = '"input"'
    if len(rest) <= len(target):
        return target.startswith(rest)
    if not rest.startswith(target):
        return False
    rest = rest[len(target):].lstrip()
    return rest in ("", ":") or (rest.startswith(":") and rest[1:].strip() == "")
