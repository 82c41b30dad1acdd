"""The generated tokens that belong to the reasoning, counted by token (usage's `reasoning_tokens`).

`ReasoningTokens` is fed each generated token's own decoded text, in order (server/detok.py `TextStream.feed`
with `texts`; a token waiting for the rest of a UTF-8 character, or one the text leaves out, has ""),
and reads it with a reader of its own: a `ReasoningSplitter` (server/reasoning.py) made as the request's,
or a `HarmonyReader` (server/harmony.py). The text is never tokenized again.

The rule, as OpenAI counts hidden reasoning: the markup is part of the reasoning. A token is reasoning
when the reader is inside the reasoning as its text begins: `<think>` and `</think>` (and a token that
straddles `</think>`, such as `think>ans`) count as reasoning, as do an analysis message's header
(`<|channel|>analysis<|message|>`) and its `<|end|>`. Tokens read before a message's kind is known
(whitespace before `<think>`; a harmony header up to `<|message|>`; `<|start|>assistant` between
messages) go with the message they open: reasoning when it is a reasoning block, else content. An
output that ends inside the block leaves all of it reasoning; one that never opens a block has none.
"""

from __future__ import annotations

from typing import Any, Protocol

from server.harmony import HarmonyReader
from server.harmony_output import HarmonyOutput
from server.reasoning import ReasoningSplitter


class Reader(Protocol):
    @property
    def position(self) -> str: ...  # "reasoning" | "content" | "open"

    def feed(self, text: str) -> Any: ...


class ReasoningTokens:
    def __init__(self, reader: Reader):
        self._reader = reader
        self.num_tokens = 0  # reasoning tokens so far
        self._num_open = 0  # tokens read while the message they belong to was not known yet

    def feed(self, text: str) -> None:
        """One generated token's own text."""
        before = self._reader.position
        self._reader.feed(text)
        if before == "reasoning":
            self.num_tokens += 1
            return
        if before == "open":
            self._num_open += 1
        after = self._reader.position
        if after != "open" and self._num_open:
            self.num_tokens += self._num_open if after == "reasoning" else 0
            self._num_open = 0


def reasoning_tokens(reasoning: ReasoningSplitter | None, tools: object) -> ReasoningTokens | None:
    """A counter for a choice read with `reasoning` (a think block) or `tools` (a harmony model's output);
    None when its output has no reasoning read apart (usage then says nothing of it)."""
    if reasoning is not None:
        return ReasoningTokens(ReasoningSplitter(inside=reasoning.inside, tags=reasoning.tags))
    if isinstance(tools, HarmonyOutput) and tools.reasoning:
        return ReasoningTokens(HarmonyReader())
    return None
