"""The incremental tool-call reader: model text in, content and tool-call events out.

`ToolCallReader(fmt, eager=...)` is fed the generated text piece by piece (split anywhere,
even inside a marker) and returns events: `("text", str)` content, `("start", index, name)`
a call begins, `("args", index, str)` a fragment of its arguments (the fragments of a call
concatenate to its arguments, a JSON object in text).

Text outside blocks is content; whitespace right before a block or after a call is dropped.
A block is read character by character (server/toolcalls/json_scan.py checks the JSON). Until a
call is committed its raw text is held; if it turns out malformed, that raw text (markers
included) is content and reading goes on after it: malformed tool-call text is never lost.

A call is committed (its "start" event sent) when it is complete, or with `eager=True`
(streaming) as soon as its name is known and its arguments object opens; its arguments then
stream as they arrive. Non-streamed responses read with `eager=False`, so a call broken
anywhere is content. A streamed call that breaks after it was committed (the JSON was
well-formed up to its arguments) keeps the arguments sent so far and the text from the first
bad character on is content. Under the call grammar (server/toolcalls/grammar.py) a call never
breaks; the output can only end inside one (max_tokens): a committed call then keeps incomplete
arguments, as OpenAI's do with finish_reason "length", and an uncommitted one is dropped, as is the
start of a marker the cut left at the end (`finish(cut_off=True)`): partial markup is never content.
"""

from __future__ import annotations

from enum import Enum

from server.toolcalls.call import CallReader, Event
from server.toolcalls.json_scan import Status
from server.toolcalls.parsers import ARGS_MARKER, ToolFormat

WHITESPACE = " \t\r\n"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class Block(Enum):
    OPEN = "open"  # after a marker or separator: "{", "[" or a name may come
    NAME = "name"  # the `name` of `name[ARGS]{...}`
    ARGS_MARKER = "args_marker"  # the "[ARGS]" of `name[ARGS]{...}`
    CALL = "call"  # a `{"name": ..., "arguments": ...}` object
    ARGS = "args"  # the `{...}` of `name[ARGS]{...}`
    AFTER_CALL = "after_call"
    END_MARKER = "end_marker"  # the format's end marker


class Outcome(Enum):
    CONSUMED = "consumed"
    LEAVE = "leave"  # the block is over; this character (and a partly matched marker) is text
    BREAK = "break"  # a committed call broke: this character and all after it are text
    FAIL = "fail"  # malformed before commit: the held raw text is content; this character is text
    FAIL_AFTER = "fail_after"  # the same with this character inside the content


class ToolCallReader:
    def __init__(self, fmt: ToolFormat, *, eager: bool):
        self.fmt = fmt
        self.eager = eager
        self.num_calls = 0
        self._events: list[Event] = []
        self._in_block = False
        self._held = ""  # text not sent yet: trailing whitespace and a possible marker start
        self._started = False  # non-whitespace output seen (a bare JSON call opens only at the start)
        self._after_block = False  # text mode right after a block's calls
        self._raw: list[str] = []  # block text since the last settled call
        self._state = Block.OPEN
        self._in_array = False
        self._after_separator = False
        self._partial = ""  # a partly matched "[ARGS]" or end marker
        self._call = CallReader(eager, fmt.args_keys, 0)

    def feed(self, text: str) -> list[Event]:
        while text:
            text = self._feed_block(text) if self._in_block else self._feed_text(text)
        return self._take()

    def finish(self, cut_off: bool = False) -> list[Event]:
        """The end of the output; `cut_off`: it ended at max_tokens (or the context's end), so a marker's
        start held at the end is partial markup and is dropped (after an EOS or a stop string it is text)."""
        if self._in_block:
            self._end_of_output()
        held, self._held = self._held, ""
        if cut_off and (partial := self._marker_prefix_len(held)):
            held = held[: len(held) - partial].rstrip(WHITESPACE) if self.num_calls else held[: len(held) - partial]
        if held.strip(WHITESPACE) or self.num_calls == 0:
            self._text(held)
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- text outside blocks ------------------------------------------------------------

    def _feed_text(self, text: str) -> str:
        """Send the text before the next marker; return what follows the marker ("": none)."""
        buffer, self._held = self._held + text, ""
        if self._after_block:  # whitespace after a call is dropped
            buffer = buffer.lstrip(WHITESPACE)
            if not buffer:
                return ""
            self._after_block = False
        if not self._started:
            stripped = buffer.lstrip(WHITESPACE)
            if not stripped:
                self._held = buffer
                return ""
            self._started = True
            if self.fmt.bare_json and stripped[0] == "{":
                self._open_block(buffer[: len(buffer) - len(stripped)])
                return stripped
        found = [(i, m) for m in self.fmt.markers if (i := buffer.find(m)) >= 0]
        if found:
            index, marker = min(found)
            before = buffer[:index]
            kept = before.rstrip(WHITESPACE)
            self._text(kept)
            self._open_block(before[len(kept):] + marker)  # whitespace before a call is dropped with it
            return buffer[index + len(marker):]
        cut = len(buffer) - self._marker_prefix_len(buffer)
        while cut > 0 and buffer[cut - 1] in WHITESPACE:
            cut -= 1
        self._text(buffer[:cut])
        self._held = buffer[cut:]
        return ""

    def _marker_prefix_len(self, buffer: str) -> int:
        longest = 0
        for marker in self.fmt.markers:
            for n in range(min(len(marker) - 1, len(buffer)), longest, -1):
                if buffer.endswith(marker[:n]):
                    longest = n
                    break
        return longest

    def _text(self, text: str) -> None:
        if text:
            self._started = True
            self._push(("text", text))

    def _push(self, event: Event) -> None:
        """Append an event, merged into the last one when both are text or both one call's args."""
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == event[0] == "text":
            self._events[-1] = ("text", last[1] + event[1])
        elif last is not None and last[0] == event[0] == "args" and last[1] == event[1]:
            self._events[-1] = ("args", last[1], last[2] + event[2])
        else:
            self._events.append(event)

    # -- blocks -------------------------------------------------------------------------

    def _open_block(self, raw: str) -> None:
        self._in_block = True
        self._raw = [raw]
        self._state = Block.OPEN
        self._in_array = self._after_separator = False

    def _feed_block(self, text: str) -> str:
        """Read block characters; return the text after the block ends ("": still inside)."""
        for i, ch in enumerate(text):
            self._raw.append(ch)
            outcome = self._block_char(ch)
            if outcome is Outcome.CONSUMED:
                if not self._in_block:  # the end marker closed the block
                    self._after_block = True
                    return text[i + 1:]
                continue
            self._in_block = False
            if outcome is Outcome.LEAVE or outcome is Outcome.BREAK:
                rest, self._partial, self._raw = self._partial + text[i:], "", []
                self._after_block = outcome is Outcome.LEAVE
                return rest
            if outcome is Outcome.FAIL:
                self._raw.pop()
            self._text("".join(self._raw))
            self._raw, self._partial = [], ""
            return text[i + 1:] if outcome is Outcome.FAIL_AFTER else text[i:]
        return ""

    def _block_char(self, ch: str) -> Outcome:
        state = self._state
        if state is Block.CALL or state is Block.ARGS:
            return self._call_char(ch)
        if state is Block.OPEN:
            return self._open_char(ch)
        if state is Block.NAME:
            if ch in NAME_CHARS:
                self._call.name_chars.append(ch)
                return Outcome.CONSUMED
            if ch == ARGS_MARKER[0]:
                self._state, self._partial = Block.ARGS_MARKER, ch
                return Outcome.CONSUMED
            return self._begin_named_args(ch)
        if state is Block.ARGS_MARKER:
            if self._partial == ARGS_MARKER:
                self._partial = ""
                return self._begin_named_args(ch)
            if ch != ARGS_MARKER[len(self._partial)]:
                return Outcome.FAIL
            self._partial += ch
            return Outcome.CONSUMED
        if state is Block.END_MARKER:
            end = self.fmt.end_marker
            if ch != end[len(self._partial)]:
                return Outcome.LEAVE
            self._partial += ch
            if self._partial == end:
                self._partial, self._raw, self._in_block = "", [], False
            return Outcome.CONSUMED
        return self._after_call_char(ch)

    def _open_char(self, ch: str) -> Outcome:
        if ch in WHITESPACE:
            return Outcome.CONSUMED
        if ch == "{":
            self._state = Block.CALL
            self._call = CallReader(self.eager, self.fmt.args_keys, self.num_calls)
            return self._call_char(ch)
        if ch == "[" and self.fmt.array and not self._in_array and not self._after_separator:
            self._in_array = True
            return Outcome.CONSUMED
        if ch in NAME_CHARS and self.fmt.named_args and not self._in_array:
            self._state = Block.NAME
            self._call = CallReader(self.eager, self.fmt.args_keys, self.num_calls)
            self._call.name_chars.append(ch)
            return Outcome.CONSUMED
        return Outcome.FAIL

    def _begin_named_args(self, ch: str) -> Outcome:
        if ch != "{":
            return Outcome.FAIL
        self._state = Block.ARGS
        self._call.begin_named_args(self._push)
        if self._call.committed:
            self.num_calls += 1
        return self._call_char(ch)

    def _call_char(self, ch: str) -> Outcome:
        was_committed = self._call.committed
        status = self._call.feed(ch, self._push)
        if self._call.committed and not was_committed:
            self.num_calls += 1
        if status is Status.ERROR:
            if not self._call.committed:
                return Outcome.FAIL
            self._settle()
            return Outcome.BREAK  # the call keeps the arguments sent
        if status is Status.DONE:
            if not self._call.committed:
                if not self._call.complete(self._push):
                    return Outcome.FAIL_AFTER
                self.num_calls += 1
            self._settle()
            return Outcome.CONSUMED
        return Outcome.CONSUMED if self._call.well_formed else Outcome.FAIL_AFTER

    def _settle(self) -> None:
        self._raw = []
        self._state = Block.AFTER_CALL
        self._after_separator = False

    def _after_call_char(self, ch: str) -> Outcome:
        if ch in WHITESPACE:
            return Outcome.CONSUMED
        if self._in_array:
            if ch == ",":
                self._state, self._after_separator = Block.OPEN, True
                return Outcome.CONSUMED
            if ch == "]":
                self._in_array = False
                self._raw = []
                return Outcome.CONSUMED
            return Outcome.FAIL
        if ch in self.fmt.separators:
            self._state, self._after_separator = Block.OPEN, True
            return Outcome.CONSUMED
        if ch == "{":
            return self._open_char(ch)
        if self.fmt.end_marker and ch == self.fmt.end_marker[0]:
            self._state, self._partial = Block.END_MARKER, ch
            return Outcome.CONSUMED
        return Outcome.LEAVE

    def _end_of_output(self) -> None:
        """The output ended inside a block (cut off by max_tokens: under the call grammar a block
        is always a call). A committed call keeps the arguments sent so far; an unfinished call not
        yet sent, or a partly written end marker, is dropped: call markup never becomes content."""
        self._in_block = False
        self._raw, self._partial = [], ""
