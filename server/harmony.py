"""GPT-OSS's "harmony" output read piece by piece: channels -> reasoning, content and tool calls.

The chat template ends the prompt with `<|start|>assistant`; the model then writes messages, each a
header, `<|message|>`, the body, and an end (`<|end|>`; `<|return|>` / `<|call|>` end the output and are
stop tokens, so the engine leaves them out of the text):

    <|channel|>analysis<|message|>Need weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

A header names its channel after `<|channel|>` and may name a recipient, `to=NAME`, before or after
the channel. A `<|channel|>` inside a body also ends it (a model that left out `<|end|><|start|>`). A message's body is:
- analysis: reasoning;
- commentary to `functions.NAME`: a call of NAME, the body its JSON arguments;
- final, commentary without a recipient (a preamble), any other channel or recipient: content.

`HarmonyReader.feed(text)` takes the text decoded with these markers kept (server/detok.py drop_ids),
split anywhere, even inside a marker (a possible marker start at a piece's end is held until the next
piece settles it, as server/reasoning.py does), and returns `Event`s: ("reasoning", text),
("content", text), ("call", name) when a call starts, ("args", text) for its arguments. `finish()` ends
the output: a body cut off stays in its channel; a header without its `<|message|>` is dropped.
Output that does not start with a header (say, one a response_format grammar kept to JSON) is all
content. Two messages of one kind (reasoning, or content) are joined by a blank line.

Detection (`speaks_harmony`): the chat template, or the tokenizer's added tokens, spell both
`<|channel|>` and `<|message|>`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

from server.reasoning import names_all

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)  # kept in the decoded text
# a body ends at the first of these; a header's start (a model that left out `<|end|><|start|>`) stays
BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
FUNCTIONS = "functions."  # the namespace the template renders a request's tools in
WHITESPACE = " \t\r\n"
SEPARATOR = "\n\n"  # between two messages of one kind

Event = tuple[str, str]  # ("reasoning" | "content" | "args", text) or ("call", name)

_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


def speaks_harmony(chat_template: Any, tokenizer: Any) -> bool:
    """Whether the model writes harmony: the chat template or the tokenizer's added tokens name both
    `<|channel|>` and `<|message|>`."""
    return names_all(chat_template, tokenizer, (CHANNEL, MESSAGE))


def header_kind(header: str) -> tuple[str, str]:
    """A header's body kind: ("reasoning" | "content", "") or ("call", function name)."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        if name.startswith(FUNCTIONS) and len(name) > len(FUNCTIONS):
            return "call", name[len(FUNCTIONS):]
        return "content", ""  # a built-in tool (browser, python): no function of the request
    channel = _CHANNEL_NAME.search(header)
    return ("reasoning", "") if channel is not None and channel.group(1) == "analysis" else ("content", "")


class State(Enum):
    FIRST = "first"  # the output's start: a header, else plain content
    HEADER = "header"  # in a header, up to `<|message|>`
    BODY = "body"  # in a message's body
    BETWEEN = "between"  # after a body's end: the next `<|start|>` (or header) comes
    PLAIN = "plain"  # no harmony: the rest is content


def _held_len(buffer: str) -> int:
    """The length of the longest end of `buffer` that begins a marker (split across pieces)."""
    start = buffer.find("<", max(0, len(buffer) - max(map(len, MARKERS)) + 1))
    while start >= 0:
        tail = buffer[start:]
        if any(marker.startswith(tail) for marker in MARKERS):
            return len(tail)
        start = buffer.find("<", start + 1)
    return 0


def _may_open(text: str) -> bool:
    """Whether `text` (leading whitespace stripped) is, or may still become, a header's start."""
    return any(opening.startswith(text) or text.startswith(opening) for opening in (CHANNEL, START, "to="))


class HarmonyReader:
    """`reasoning=False` (--reasoning-format none): analysis bodies are content too."""

    def __init__(self, *, reasoning: bool = True) -> None:
        self._reasoning = reasoning
        self._state = State.FIRST
        self._held = ""  # text not read yet: a possible marker start, or a header so far
        self._kind = "content"  # the current body's kind: "reasoning" | "content" | "call"
        self._wrote: set[str] = set()  # kinds with text so far (the next message of one is separated)
        self._body_started = False  # the current body has text
        self._events: list[Event] = []

    @property
    def position(self) -> str:
        """Where the text read next goes: "reasoning" (an analysis body), "content" (any other body, calls
        included), or "open" (a header, or between messages: the next message's kind is not known yet)."""
        if self._state is State.BODY:
            return "reasoning" if self._kind == "reasoning" else "content"
        return "content" if self._state is State.PLAIN else "open"

    def feed(self, text: str) -> list[Event]:
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._step(buffer)
        return self._take()

    def finish(self) -> list[Event]:
        """The end of the output: held text of a body stays in its channel; an unfinished header is dropped."""
        held, self._held = self._held, ""
        if self._state in (State.BODY, State.PLAIN):
            self._text(held)
        elif self._state is State.FIRST:
            self._text(held)  # whitespace, or the start of a marker that never came
        return self._take()

    def _step(self, buffer: str) -> str:
        """Read from `buffer`; return what is left to read ("": all read or held)."""
        state = self._state
        if state is State.PLAIN:
            self._text(buffer)
            return ""
        if state in (State.FIRST, State.BETWEEN):
            stripped = buffer.lstrip(WHITESPACE)
            if not stripped or (_may_open(stripped) and len(stripped) < len(CHANNEL)):
                self._held = buffer  # not settled yet
                return ""
            if stripped.startswith(START):
                self._state = State.HEADER
                return stripped[len(START):]
            if _may_open(stripped):
                self._state = State.HEADER
                return stripped
            if state is State.FIRST:
                self._state = State.PLAIN
                return buffer
            self._open_body("content")  # text between messages: content
            return stripped
        if state is State.HEADER:
            index = buffer.find(MESSAGE)
            if index < 0:
                self._held = buffer
                return ""
            kind, name = header_kind(buffer[:index])
            if kind == "reasoning" and not self._reasoning:
                kind = "content"
            self._open_body(kind)
            if kind == "call":
                self._events.append(("call", name))
            return buffer[index + len(MESSAGE):]
        return self._body(buffer)

    def _body(self, buffer: str) -> str:
        ends = [(i, marker) for marker in BODY_ENDS if (i := buffer.find(marker)) >= 0]
        if ends:
            index, marker = min(ends)
            self._text(buffer[:index])
            self._state = State.BETWEEN
            return buffer[index + (0 if marker in (START, CHANNEL) else len(marker)):]
        cut = len(buffer) - _held_len(buffer)
        self._text(buffer[:cut])
        self._held = buffer[cut:]
        return ""

    def _open_body(self, kind: str) -> None:
        self._state, self._kind, self._body_started = State.BODY, kind, False

    def _text(self, text: str) -> None:
        if not text:
            return
        kind = "content" if self._state is State.PLAIN else self._kind
        if kind == "call":
            self._push("args", text)
            return
        if not self._body_started and kind in self._wrote:
            text = SEPARATOR + text
        self._body_started = True
        self._wrote.add(kind)
        self._push(kind, text)

    def _push(self, kind: str, text: str) -> None:
        if self._events and self._events[-1][0] == kind:
            self._events[-1] = (kind, self._events[-1][1] + text)
        else:
            self._events.append((kind, text))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events
