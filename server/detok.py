"""Incremental detokenization and stop strings across token boundaries.

`Detokenizer` turns a growing list of token ids into text deltas and never emits half a
UTF-8 character: while the decoded tail ends in U+FFFD (an incomplete byte sequence) it
waits for more tokens. It decodes a short window (prefix_offset..end), as TGI and vLLM do,
so each step costs O(window), not O(sequence).

`StopMatcher` holds back the longest text suffix that could still start a stop string,
so a stop string split over several tokens is found and never returned.

`TextStream` combines both, token by token, and counts the tokens consumed up to and
including the one that completed a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Detokenizer:
    """`drop_ids`: when given, these ids are dropped and the rest decoded with special tokens kept
    (a tool-call marker that is a special token stays in the text; server/toolcalls/detect.py)."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True,
                 drop_ids: frozenset[int] | None = None):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._drop_ids = drop_ids
        self._special: frozenset[int] | None = None  # the special ids decoding skips (made on first use)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (context for spacing/merges)
        self._read_offset = 0  # ids before this offset have been emitted as text

    def drops(self, token_id: int) -> bool:
        """Whether decoding leaves this token out of the text (a special token, or one of drop_ids)."""
        if self._drop_ids is not None:
            return token_id in self._drop_ids
        if not self._skip_special:
            return False
        if self._special is None:
            added = getattr(self._tokenizer, "added_tokens_decoder", {})
            self._special = frozenset(getattr(self._tokenizer, "all_special_ids", ())) | frozenset(
                i for i, token in added.items() if getattr(token, "special", False))
        return token_id in self._special

    def _decode(self, ids: list[int]) -> str:
        if self._drop_ids is not None:
            return self._tokenizer.decode([i for i in ids if i not in self._drop_ids], skip_special_tokens=False)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: whatever is left, incomplete bytes decoded as U+FFFD."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""  # text not yet returned: a possible start of a stop string
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the text that is safe to emit; after a match, `matched` is set and text ends."""
        if self.matched is not None:
            return ""
        buffer = self._pending + text
        if not self._stops:
            return buffer
        hits = [(buffer.find(s), s) for s in self._stops]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            self.matched = stop
            self._pending = ""
            return buffer[:pos]
        hold = self._held_suffix_len(buffer)
        self._pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def _held_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return "" if self.matched is not None else rest


class TextStream:
    """Token ids in, safe text out; `stopped` once a stop string matched."""

    def __init__(self, tokenizer: Decoder, stops: Sequence[str] = (), drop_ids: frozenset[int] | None = None):
        self._detok = Detokenizer(tokenizer, drop_ids=drop_ids)
        self._stop = StopMatcher(stops)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self._stop.matched is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop.matched

    def drops(self, token_id: int) -> bool:
        """Whether the text leaves this token out (special tokens)."""
        return self._detok.drops(token_id)

    def halt(self) -> None:
        """End the text here, as a stop string would (with no stop string: `stop_string` is "")."""
        if self._stop.matched is None:
            self._stop.matched = ""

    def feed(self, token_ids: Sequence[int], texts: list[str] | None = None) -> str:
        """The safe text of `token_ids`; `texts`, when given, gets each consumed token's own decoded text
        (before stop strings are looked for; "" while a character is incomplete or for a dropped token)."""
        out: list[str] = []
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            text = self._detok.add(token_id)
            if texts is not None:
                texts.append(text)
            out.append(self._stop.feed(text))
        return "".join(out)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._stop.feed(self._detok.flush()) + self._stop.flush()
