"""Messages API output: the `message` object, its content blocks, and the stream events that build them.

`ContentBlocks` turns one generation's deltas (content, or tool-call entries: server/toolcalls/output.py)
into content blocks, `text` and `tool_use`, in the order the model wrote them, and into the events
Anthropic's SDKs parse: `content_block_start`, `content_block_delta` (`text_delta`, `input_json_delta`),
`content_block_stop`. The same object serves whole messages (its events unused). A `tool_use` block's
`input` is its arguments parsed (streamed: `{}` at the start, then the JSON text in pieces).

Usage follows Anthropic's prompt-caching fields: `input_tokens` are the prompt tokens the prefix cache
did not serve, `cache_read_input_tokens` those it did (their sum is the prompt),
`cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.generation import Generation
from server.toolcalls.output import Delta

Event = tuple[str, dict[str, Any]]  # (type, fields besides type)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ContentBlocks:
    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the block still being written
        self._arguments: dict[int, list[str]] = {}  # tool_use block index -> its JSON text so far
        self._call_blocks: dict[int, int] = {}  # tool-call index -> block index

    def feed(self, delta: Delta) -> list[Event]:
        if delta.reasoning is not None:  # a `thinking` block (server/reasoning.py); signature empty
            return self._thinking(delta.reasoning) if delta.reasoning else []
        if delta.content is not None:
            return self._text(delta.content) if delta.content else []
        assert delta.tool_call is not None
        entry = delta.tool_call
        if "id" in entry:  # a call starts
            events = self._close()
            index = len(self.blocks)
            self._call_blocks[entry["index"]] = index
            self.blocks.append({"type": "tool_use", "id": "toolu_" + entry["id"].removeprefix("call_"),
                                "name": entry["function"]["name"], "input": {}})
            self._arguments[index] = []
            self._open = index
            return events + [("content_block_start", {"index": index, "content_block": dict(self.blocks[index])})]
        index = self._call_blocks[entry["index"]]
        piece = entry["function"]["arguments"]
        self._arguments[index].append(piece)
        return [("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}})]

    def close(self) -> list[Event]:
        """End of output: close the open block; every tool_use block gets its parsed input."""
        events = self._close()
        for index, pieces in self._arguments.items():
            self.blocks[index]["input"] = _input("".join(pieces))
        return events

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.blocks[self._open]["type"] != "text":
            events += self._close()
            self._open = len(self.blocks)
            self.blocks.append({"type": "text", "text": ""})
            events.append(("content_block_start", {"index": self._open, "content_block": {"type": "text", "text": ""}}))
        self.blocks[self._open]["text"] += text
        return events + [("content_block_delta", {"index": self._open, "delta": {"type": "text_delta", "text": text}})]

    def _thinking(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.blocks[self._open]["type"] != "thinking":
            events += self._close()
            self._open = len(self.blocks)
            self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            events.append(("content_block_start", {"index": self._open, "content_block": dict(self.blocks[self._open])}))
        self.blocks[self._open]["thinking"] += text
        return events + [("content_block_delta", {"index": self._open,
                                                  "delta": {"type": "thinking_delta", "thinking": text}})]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [("content_block_stop", {"index": index})]


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object: a call cut off by max_tokens keeps what parses (else {})."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(gen: Generation) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    assert gen.finish_reason is not None
    reason = gen.finish_reason if gen.tools is None else gen.tools.finish_reason(gen.finish_reason)
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if gen.text.stop_string:
        return "stop_sequence", gen.text.stop_string
    return "end_turn", None


def usage(gen: Generation) -> dict[str, int]:
    cached = gen.totals.cached_tokens if gen.totals is not None else 0
    return {"input_tokens": gen.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": gen.completion_tokens}


@dataclass
class MessageHead:
    """What every snapshot of one message shares."""

    model: str
    id: str = field(default_factory=lambda: new_id("msg"))

    def body(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}
