"""The incremental reader of GLM-4.5 / 4.6 / 4.7's tool calls (the glm45 format of server/toolcalls/parsers.py):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

one call per `<tool_call>` block; GLM-4.7's template writes the same without the newlines, and any
whitespace may stand between the name and `<arg_key>`, between `</arg_key>` and `<arg_value>` and
between arguments (the call grammar's "glm_xml" style allows it: server/toolcalls/grammar.py).
A value is everything between `<arg_value>` and the first `</arg_value>`, newlines included (GLM's
templates print a string raw, anything else as JSON); server/toolcalls/xml_values.py types it by
the tool's schema. A key is the text between `<arg_key>` and `</arg_key>`, stripped.

The markup is read here, a character at a time; the arguments and when a call is sent are
server/toolcalls/xml_call.py's. A call starts at its first `<arg_key>` (or at `</tool_call>` for a
call without arguments): streamed, it is committed there; whole, at `</tool_call>` (or the output's end
right after a complete value). A name holding a
character no tool name has (`<tool_call>\\n{"name": ...` is Hermes JSON, not this) is content.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from server.toolcalls.parsers import ToolFormat
from server.toolcalls.stream import WHITESPACE, Outcome
from server.toolcalls.xml_call import XmlArgsReader

ARG_KEY = "<arg_key>"
KEY_END = "</arg_key>"
ARG_VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
BLOCK_END = "</tool_call>"
NOT_IN_NAMES = frozenset(WHITESPACE + "<>=\"'{}()[],;")


class Glm(Enum):
    NAME = "name"  # after <tool_call>: the function's name, until whitespace or "<"
    BODY = "body"  # "<arg_key>" or "</tool_call>" comes (the first one starts the call)
    KEY = "key"  # after "<arg_key>": the key's text, then "</arg_key>"
    AFTER_KEY = "after_key"  # "<arg_value>" comes
    VALUE = "value"  # a value's text, until "</arg_value>"


LITERALS = {Glm.BODY: (ARG_KEY, BLOCK_END), Glm.KEY: (KEY_END,), Glm.AFTER_KEY: (ARG_VALUE,)}  # what each state expects


class GlmCallReader(XmlArgsReader):
    value_end = VALUE_END
    trim_newlines = False

    def __init__(self, fmt: ToolFormat, *, eager: bool, schemas: dict[str, Any] | None = None):
        super().__init__(fmt, eager=eager, schemas=schemas)
        self._glm = Glm.NAME
        self._name: list[str] = []  # the function's name
        self._key: list[str] = []  # the current argument's key
        self._word = ""  # the literal being matched (also in _partial, the markup not settled yet)

    def _open_block(self, raw: str) -> None:
        super()._open_block(raw)
        self._glm, self._name, self._key, self._word = Glm.NAME, [], [], ""

    def _block_char(self, ch: str) -> Outcome:
        state = self._glm
        if state is Glm.VALUE:
            if self._value_char(ch):
                self._glm = Glm.BODY
            return Outcome.CONSUMED
        if state is Glm.NAME:
            if ch not in NOT_IN_NAMES:
                self._name.append(ch)
                return Outcome.CONSUMED
            if not self._name and ch in WHITESPACE:  # whitespace before the name
                return Outcome.CONSUMED
            if not self._name or ch not in WHITESPACE + "<":
                return self._broken()
            self._glm = Glm.BODY  # the name is over: ch is the body's
        elif state is Glm.KEY and not self._word and ch != "<":
            self._key.append(ch)
            self._partial += ch
            return Outcome.CONSUMED
        return self._literal_char(ch)

    def _literal_char(self, ch: str) -> Outcome:
        """One character of markup: whitespace between literals, or the next one of a literal the state expects."""
        if not self._word and ch in WHITESPACE and self._glm is not Glm.KEY:
            if self._partial:
                self._partial += ch
            return Outcome.CONSUMED
        word = self._word + ch
        literals = LITERALS[self._glm]
        if not any(literal.startswith(word) for literal in literals):
            return self._broken()
        self._word, self._partial = word, self._partial + ch
        if word not in literals:
            return Outcome.CONSUMED
        self._word = ""
        if word == ARG_KEY:
            self._start_call()
            self._glm, self._key = Glm.KEY, []
        elif word == KEY_END:
            if not "".join(self._key).strip():
                return self._broken()
            self._glm = Glm.AFTER_KEY
        elif word == ARG_VALUE:
            self._begin_parameter("".join(self._key).strip())
            self._glm, self._partial = Glm.VALUE, ""
        else:  # </tool_call>: the call and its block end
            self._start_call()
            self._end_function()
            self._in_block = False
        return Outcome.CONSUMED

    def _end_of_output(self) -> None:
        """The output ended inside a block: a call whose last value was complete ends there (as if
        `</tool_call>` came: EOS before it); else as server/toolcalls/xml_call.py's."""
        if self._xcall is not None and self._glm is Glm.BODY and not self._word:
            self._end_function()
        super()._end_of_output()

    def _start_call(self) -> None:
        if self._xcall is None:
            self._begin_function("".join(self._name))
