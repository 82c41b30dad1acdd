"""An incremental JSON syntax checker for one value, fed a character at a time.

`JsonScanner.feed(ch)` says whether `ch` continues the value (MORE), completes it (DONE) or
cannot appear there (ERROR), so a tool call is known to be malformed at its first bad
character, before anything of it has been sent. After each character, `last` is its text in
the normalised output: raw control characters inside strings are escaped (models write
literal newlines in string arguments; clients' strict JSON parsers reject them), everything
else is kept as written, so the normalised text of a DONE value is strict JSON.

`events` reports the members of the outermost object, at positions in the normalised output
(`pos` is its length so far): `("key", name)` when a depth-1 key is complete, `("start",
name, pos)` when its value begins at `pos`, `("end", name, pos)` when it ends before `pos`.
"""

from __future__ import annotations

import json
from enum import Enum

WHITESPACE = " \t\r\n"
ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
SIMPLE_ESCAPES = '"\\/bfnrt'
HEX = "0123456789abcdefABCDEF"
LITERALS = {"t": "true", "f": "false", "n": "null"}
# number DFA: state -> (digit, "-", "+", ".", "eE"); None: not allowed. Accepting: zero, int, frac, exp.
NUMBER_MOVES: dict[str, tuple[str | None, ...]] = {
    "start": ("int", "minus", None, None, None),
    "minus": ("int", None, None, None, None),
    "zero": (None, None, None, "frac0", "exp0"),
    "int": ("int", None, None, "frac0", "exp0"),
    "frac0": ("frac", None, None, None, None),
    "frac": ("frac", None, None, None, "exp0"),
    "exp0": ("exp", "expsign", "expsign", None, None),
    "expsign": ("exp", None, None, None, None),
    "exp": ("exp", None, None, None, None),
}
NUMBER_ACCEPTING = frozenset({"zero", "int", "frac", "exp"})


class Status(Enum):
    MORE = "more"
    DONE = "done"
    ERROR = "error"


class Expect(Enum):
    VALUE = "value"
    KEY_OR_CLOSE = "key_or_close"  # just after "{"
    VALUE_OR_CLOSE = "value_or_close"  # just after "["
    KEY = "key"  # after "," in an object
    COLON = "colon"
    COMMA_OR_CLOSE = "comma_or_close"
    STRING = "string"
    ESCAPE = "escape"
    UNICODE = "unicode"
    NUMBER = "number"
    LITERAL = "literal"
    DONE = "done"


class JsonScanner:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.last = ""  # the normalised text of the last character fed
        self.pos = 0  # length of the normalised output so far
        self._key_chars: list[str] = []  # the depth-1 key being read
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = Expect.VALUE
        self._string_is_key = False
        self._hex_left = 0
        self._number = "start"
        self._literal = ""  # the rest of the literal still expected
        self._key: str | None = None  # the depth-1 key whose value is being read

    def feed(self, ch: str) -> Status:
        if self._expect is Expect.DONE:
            return Status.ERROR
        if self._expect is Expect.NUMBER and not self._number_continues(ch):
            if self._number not in NUMBER_ACCEPTING:
                return Status.ERROR
            self._end_value()  # the number ended just before ch; ch is read as what follows it
            if self._expect is Expect.DONE:
                return Status.ERROR  # a bare top-level number is not a value this scanner reads
        status = self._read(ch)
        if status is Status.ERROR:
            return status
        self.last = self._normalise(ch)
        self.pos += len(self.last)
        if self._expect is Expect.DONE:
            return Status.DONE
        return Status.MORE

    # -- one character -------------------------------------------------------------------

    def _read(self, ch: str) -> Status:
        expect = self._expect
        if expect is Expect.STRING:
            return self._read_string(ch)
        if self._string_is_key and expect in (Expect.ESCAPE, Expect.UNICODE):
            self._key_chars.append(ch)
        if expect is Expect.ESCAPE:
            if ch == "u":
                self._expect, self._hex_left = Expect.UNICODE, 4
            elif ch in SIMPLE_ESCAPES:
                self._expect = Expect.STRING
            else:
                return Status.ERROR
            return Status.MORE
        if expect is Expect.UNICODE:
            if ch not in HEX:
                return Status.ERROR
            self._hex_left -= 1
            if self._hex_left == 0:
                self._expect = Expect.STRING
            return Status.MORE
        if expect is Expect.NUMBER:
            return Status.MORE  # _number_continues already advanced the DFA
        if expect is Expect.LITERAL:
            if ch != self._literal[0]:
                return Status.ERROR
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value(after=1)
            return Status.MORE
        if ch in WHITESPACE:
            return Status.MORE
        return self._read_structural(ch)

    def _read_structural(self, ch: str) -> Status:
        expect = self._expect
        if expect in (Expect.VALUE, Expect.VALUE_OR_CLOSE):
            if ch == "]" and expect is Expect.VALUE_OR_CLOSE:
                return self._close("[")
            return self._start_value(ch)
        if expect in (Expect.KEY_OR_CLOSE, Expect.KEY):
            if ch == "}" and expect is Expect.KEY_OR_CLOSE:
                return self._close("{")
            if ch != '"':
                return Status.ERROR
            self._expect, self._string_is_key = Expect.STRING, True
            self._key_chars = []
            return Status.MORE
        if expect is Expect.COLON:
            if ch != ":":
                return Status.ERROR
            self._expect = Expect.VALUE
            return Status.MORE
        if expect is Expect.COMMA_OR_CLOSE:
            if ch == ",":
                self._expect = Expect.KEY if self._stack[-1] == "{" else Expect.VALUE
                return Status.MORE
            if ch in "}]":
                return self._close("{" if ch == "}" else "[")
        return Status.ERROR

    def _start_value(self, ch: str) -> Status:
        if len(self._stack) == 1 and self._stack[0] == "{" and self._key is not None:
            self.events.append(("start", self._key, self.pos))
        if ch in "{[":
            self._stack.append(ch)
            self._expect = Expect.KEY_OR_CLOSE if ch == "{" else Expect.VALUE_OR_CLOSE
        elif ch == '"':
            self._expect, self._string_is_key = Expect.STRING, False
        elif ch in LITERALS:
            self._expect, self._literal = Expect.LITERAL, LITERALS[ch][1:]
        elif ch == "-" or ch.isdigit():
            self._expect = Expect.NUMBER
            self._number = "zero" if ch == "0" else ("minus" if ch == "-" else "int")
        else:
            return Status.ERROR
        return Status.MORE

    def _read_string(self, ch: str) -> Status:
        if ch == '"':
            if self._string_is_key:
                self._expect = Expect.COLON
                if len(self._stack) == 1:
                    self._key = json.loads('"' + "".join(self._key_chars) + '"', strict=False)
                    self.events.append(("key", self._key))
            else:
                self._end_value(after=1)
            return Status.MORE
        if ch == "\\":
            self._expect = Expect.ESCAPE
        if self._string_is_key:
            self._key_chars.append(ch)
        return Status.MORE

    def _number_continues(self, ch: str) -> bool:
        if ch in "0123456789":
            if ch == "0" and self._number in ("start", "minus"):
                self._number = "zero"
                return True
            column = 0
        else:
            column = {"-": 1, "+": 2, ".": 3, "e": 4, "E": 4}.get(ch)
            if column is None:
                return False
        move = NUMBER_MOVES[self._number][column]
        if move is None:
            return False
        self._number = move
        return True

    def _close(self, opener: str) -> Status:
        if not self._stack or self._stack[-1] != opener:
            return Status.ERROR
        self._stack.pop()
        self._end_value(after=1)
        return Status.MORE

    def _end_value(self, after: int = 0) -> None:
        """The value that is being read ends `after` characters past the current position."""
        if not self._stack:
            self._expect = Expect.DONE
            return
        self._expect = Expect.COMMA_OR_CLOSE
        if len(self._stack) == 1 and self._stack[0] == "{" and self._key is not None:
            self.events.append(("end", self._key, self.pos + after))
            self._key = None

    def _normalise(self, ch: str) -> str:
        if self._expect is Expect.STRING and ord(ch) < 0x20:  # a raw control character inside a string
            return ESCAPES.get(ch, f"\\u{ord(ch):04x}")
        return ch
