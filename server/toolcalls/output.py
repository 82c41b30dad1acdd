"""One choice's generated text -> OpenAI content and tool calls, streamed or whole.

Streamed (`feed` / `finish`): a list of `Delta`s per piece of text, each one chunk's delta:
content, or one call's entry of `delta.tool_calls`. A call's first entry carries its index,
id, type and name with `arguments: ""`; the following entries carry argument fragments.
Whole (`message`): `content` (None when only calls were made) and `tool_calls`.
`finish_reason` becomes "tool_calls" when a call was made and the model stopped by itself.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from server.toolcalls.glm_stream import GlmCallReader
from server.toolcalls.parsers import ToolFormat
from server.toolcalls.stream import Event, ToolCallReader
from server.toolcalls.xml_call import XmlArgsReader
from server.toolcalls.xml_stream import XmlCallReader

XML_READERS: dict[str, type[XmlArgsReader]] = {"qwen3_coder": XmlCallReader, "glm45": GlmCallReader}  # format -> reader


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class Delta:
    content: str | None = None
    tool_call: dict[str, Any] | None = None  # one entry of `delta.tool_calls`
    reasoning: str | None = None  # reasoning text (server/reasoning.py), apart from the content

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return None if self.tool_call is None else [self.tool_call]


class ToolOutput:
    def __init__(self, fmt: ToolFormat, *, eager: bool, max_calls: int | None = None,
                 schemas: dict[str, Any] | None = None):
        """`schemas`: tool name -> its `parameters` (the XML format types its values by them)."""
        self._reader = (XML_READERS[fmt.name](fmt, eager=eager, schemas=schemas) if fmt.xml
                        else ToolCallReader(fmt, eager=eager))
        self._max_calls = max_calls
        self._ids: list[str] = []  # id of call i

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._reader.feed(text))

    def finish(self, finish_reason: str | None = None) -> list[Delta]:
        """The deltas left at the end of the output (`finish_reason` "length": it was cut off)."""
        return self._deltas(self._reader.finish(cut_off=finish_reason == "length"))

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def message(self, text: str, finish_reason: str | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The whole output: (content, tool_calls); content None when only calls were made."""
        _, content, calls = collect(self.feed(text) + self.finish(finish_reason))
        if not calls:
            return content, None
        return (content or None), list(calls.values())

    def whole(self, text: str, finish_reason: str | None = None) -> tuple[None, str | None, list[dict[str, Any]] | None]:
        """`message` as a Generation reads a reply (server/harmony_output.py's HarmonyOutput.whole): no reasoning."""
        return (None, *self.message(text, finish_reason))

    def _deltas(self, events: list[Event]) -> list[Delta]:
        out: list[Delta] = []
        for event in events:
            if event[0] == "text":
                out.append(Delta(content=event[1]))
                continue
            index = event[1]
            if self._max_calls is not None and index >= self._max_calls:
                continue  # parallel_tool_calls false / a named tool_choice: the first call only
            if event[0] == "start":
                self._ids.append(new_call_id())
                entry = {"index": index, "id": self._ids[index], "type": "function",
                         "function": {"name": event[2], "arguments": ""}}
            else:
                entry = {"index": index, "function": {"arguments": event[2]}}
            out.append(Delta(tool_call=entry))
        return out


def collect(deltas: list[Delta]) -> tuple[str | None, str, dict[int, dict[str, Any]]]:
    """Deltas holding each call's entries whole (a whole output, or a batch read with eager=False) ->
    (reasoning, None without any; content; call index -> its `tool_calls` entry, arguments JSON text)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}  # call index -> its entry
    for delta in deltas:
        if delta.reasoning is not None:
            reasoning.append(delta.reasoning)
        elif delta.content is not None:
            content.append(delta.content)
        elif delta.tool_call is not None and "id" in delta.tool_call:
            function = delta.tool_call["function"]
            calls[delta.tool_call["index"]] = {"id": delta.tool_call["id"], "type": "function",
                                               "function": {"name": function["name"], "arguments": function["arguments"]}}
        elif delta.tool_call is not None:
            calls[delta.tool_call["index"]]["function"]["arguments"] += delta.tool_call["function"]["arguments"]
    return ("".join(reasoning) if reasoning else None), "".join(content), calls
