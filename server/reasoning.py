"""Reasoning kept apart from the answer: `<think> ... </think>` (llama.cpp's `--reasoning-format auto`).

`ReasoningSplitter(inside=...)` is fed a chat generation's text piece by piece (split anywhere, even
inside a tag) and returns parts: `("reasoning", str)` or `("content", str)`. Only a block at the
start of the output is reasoning (after leading whitespace); `inside=True` when the generation prompt
already opened `<think>` (Qwen3, SmolLM3, GLM templates), so the output starts inside it. Without a
leading block the whole output is content, as before. Whitespace just inside the tags and right after
`</think>` is dropped. A possible tag start at the end of a piece is held until the next piece settles
it (as the tool-call reader holds a marker's start: server/toolcalls/stream.py); the output ending
inside the block leaves all of it reasoning. Content then goes on to the tool-call reader, if any.

Detection (`think_tags`): the chat template, or the tokenizer's added tokens, spell both tags of a pair:
`<think>` (Qwen3, DeepSeek-R1, GLM, ...), Mistral's `[THINK]` (Magistral, Ministral 3 Reasoning) or
Seed-OSS's `<seed:think>`; the splitter, the prompt's opening and the grammar's block use that pair.

Structured output (`reasoning_first`): a request's grammar (response_format, guided_*, Ollama's `format`,
the Responses API's `text.format`, the tool calls' grammar) applies after the block, as vLLM applies
structured outputs after its reasoning parser: the model thinks, then answers under the grammar. How the
generation prompt leaves the block (`prompt_reasoning`) says whether the block is optional (the model may
answer at once), already open, or off (an empty block closed by the template: Qwen3's
`enable_thinking: false`; or the request asked for no thinking): then the grammar applies from the start.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

from engine.types import ReasoningBlock, StructuredOutput

OPEN = "<think>"
CLOSE = "</think>"
WHITESPACE = " \t\r\n"

Part = tuple[str, str]  # ("reasoning" | "content", text)


@dataclasses.dataclass(frozen=True)
class ThinkTags:
    """A family's reasoning block tags."""

    open: str
    close: str


THINK = ThinkTags(OPEN, CLOSE)  # Qwen3, Qwen3.5, DeepSeek-R1, GLM, SmolLM3, Phi-4-reasoning, ...
# Magistral and Ministral 3 Reasoning (Mistral's [THINK] special tokens), ByteDance Seed-OSS; before
# THINK, whose tags a template of these may also name in its text
TAG_PAIRS = (ThinkTags("[THINK]", "[/THINK]"), ThinkTags("<seed:think>", "</seed:think>"), THINK)


def think_tags(chat_template: Any, tokenizer: Any) -> ThinkTags | None:
    """The reasoning tags the model writes: the first pair of TAG_PAIRS the chat template, or else the
    tokenizer's added tokens, name both of; None: the model writes no reasoning block."""
    return next((tags for tags in TAG_PAIRS if names_all(chat_template, tokenizer, (tags.open, tags.close))), None)


def names_all(chat_template: Any, tokenizer: Any, tags: tuple[str, ...]) -> bool:
    """Whether the chat template (text, or a dict/list of named templates), or else the tokenizer's added
    tokens, name every one of `tags`."""
    source = chat_template if isinstance(chat_template, str) else str(chat_template or "")
    if all(tag in source for tag in tags):
        return True
    try:
        added = set(tokenizer.get_added_vocab())
    except Exception:  # a tokenizer without added tokens
        return False
    return all(tag in added for tag in tags)


def prompt_opens_reasoning(prompt_text: str, tags: ThinkTags = THINK) -> bool:
    """Whether the generation prompt ends with an open `<think>` (the output then starts inside it)."""
    return prompt_text.rstrip(WHITESPACE).endswith(tags.open)


class Opening(Enum):
    """How a reply's reasoning block may begin, from the generation prompt."""

    FREE = "free"  # the output may open a block (or answer at once)
    OPENED = "opened"  # the prompt opened `<think>`: the output starts inside the block
    OFF = "off"  # no thinking: the prompt closed an empty block, or the request turned thinking off


def prompt_reasoning(prompt_text: str, thinking: bool = True, tags: ThinkTags = THINK) -> Opening:
    """The opening of a reply to `prompt_text` (its end is enough); `thinking`: False where the request
    turned thinking off (`enable_thinking: false`), which an open `<think>` in the prompt overrides."""
    if prompt_opens_reasoning(prompt_text, tags):
        return Opening.OPENED
    return Opening.OFF if prompt_text.rstrip(WHITESPACE).endswith(tags.close) or not thinking else Opening.FREE


def reasoning_first(spec: StructuredOutput, opening: Opening, tags: ThinkTags = THINK) -> StructuredOutput:
    """`spec` applied after the reply's reasoning block: the block optional (FREE) or already open
    (OPENED); with thinking OFF, `spec` as it is."""
    if opening is Opening.OFF:
        return spec
    return dataclasses.replace(spec, reasoning=ReasoningBlock(tags.open, tags.close,
                                                              opened=opening is Opening.OPENED))


class State(Enum):
    START = "start"  # nothing but whitespace yet: a block may open
    INSIDE = "inside"  # in the reasoning
    AFTER = "after"  # right after `</think>`: whitespace dropped
    CONTENT = "content"  # the rest is content


def _prefix_len(buffer: str, tag: str) -> int:
    """The length of the longest end of `buffer` that begins `tag` (a tag split across pieces)."""
    for n in range(min(len(tag) - 1, len(buffer)), 0, -1):
        if buffer.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, *, inside: bool = False, tags: ThinkTags = THINK):
        self.inside = inside  # the output starts inside the block (the generation prompt opened it)
        self.tags = tags
        self._state = State.INSIDE if inside else State.START
        self.saw_block = inside  # a reasoning block was opened (so the reply has a reasoning field)
        self._started = False  # reasoning text seen (its leading whitespace is dropped)
        self._held = ""
        self._parts: list[Part] = []

    @property
    def position(self) -> str:
        """Where the text read next goes: "reasoning", "content", or "open" (a block may still open)."""
        if self._state is State.START:
            return "open"
        return "reasoning" if self._state is State.INSIDE else "content"

    def feed(self, text: str) -> list[Part]:
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._step(buffer)
        return self._take()

    def finish(self) -> list[Part]:
        held, self._held = self._held, ""
        if self._state is State.START:
            self._push("content", held)
        elif self._state is State.INSIDE:
            self._push("reasoning", held.rstrip(WHITESPACE))
        return self._take()

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output: (reasoning, None without a block; content)."""
        reasoning: list[str] = []
        content: list[str] = []
        for kind, piece in self.feed(text) + self.finish():
            (reasoning if kind == "reasoning" else content).append(piece)
        return ("".join(reasoning) if self.saw_block else None), "".join(content)

    def _step(self, buffer: str) -> str:
        """Read from `buffer`; return what is left to read ("": all read or held)."""
        state = self._state
        if state is State.CONTENT:
            self._push("content", buffer)
            return ""
        if state is State.AFTER:
            buffer = buffer.lstrip(WHITESPACE)
            if buffer:
                self._state = State.CONTENT
            return buffer
        if state is State.START:
            stripped = buffer.lstrip(WHITESPACE)
            if stripped.startswith(self.tags.open):
                self._state, self.saw_block = State.INSIDE, True
                return stripped[len(self.tags.open):]
            if self.tags.open.startswith(stripped):  # only whitespace, or a tag's start so far
                self._held = buffer
                return ""
            self._state = State.CONTENT
            return buffer
        if not self._started:
            buffer = buffer.lstrip(WHITESPACE)
            if not buffer:
                return ""
            self._started = True
        index = buffer.find(self.tags.close)
        if index >= 0:
            self._push("reasoning", buffer[:index].rstrip(WHITESPACE))
            self._state = State.AFTER
            return buffer[index + len(self.tags.close):]
        cut = len(buffer) - _prefix_len(buffer, self.tags.close)
        while cut > 0 and buffer[cut - 1] in WHITESPACE:  # whitespace before `</think>` is dropped
            cut -= 1
        self._push("reasoning", buffer[:cut])
        self._held = buffer[cut:]
        return ""

    def _push(self, kind: str, text: str) -> None:
        if not text:
            return
        if self._parts and self._parts[-1][0] == kind:
            self._parts[-1] = (kind, self._parts[-1][1] + text)
        else:
            self._parts.append((kind, text))

    def _take(self) -> list[Part]:
        parts, self._parts = self._parts, []
        return parts
