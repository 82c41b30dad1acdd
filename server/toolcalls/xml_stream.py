"""The incremental reader of Qwen's XML tool calls (the qwen3_coder format of server/toolcalls/parsers.py):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The markup is read here, a character at a time; the arguments, their typing and when a call is sent
are server/toolcalls/xml_call.py's. One newline right after `<parameter=k>` and one right before
`</parameter>` are the format's, not the value's. Streamed, a call is committed at `<function=name>`;
whole, at its `</function>`. `<function=` without `<tool_call>` before it opens a call too (vLLM
reads such output as a call).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from server.toolcalls.parsers import ToolFormat
from server.toolcalls.stream import WHITESPACE, Outcome
from server.toolcalls.xml_call import XmlArgsReader

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
BLOCK_END = "</tool_call>"
NOT_IN_NAMES = frozenset(WHITESPACE + "<>=\"'")


class Xml(Enum):
    OPEN = "open"  # after <tool_call>: "<function=" comes
    FUNCTION_NAME = "function_name"  # after "<function=", until ">"
    BODY = "body"  # inside <function=f>: "<parameter=" or "</function>" comes
    PARAMETER_NAME = "parameter_name"  # after "<parameter=", until ">"
    VALUE = "value"  # a parameter's text, until "</parameter>"
    AFTER_FUNCTION = "after_function"  # "</tool_call>" or another "<function=" comes


class XmlCallReader(XmlArgsReader):
    value_end = PARAMETER_END
    trim_newlines = True

    def __init__(self, fmt: ToolFormat, *, eager: bool, schemas: dict[str, Any] | None = None):
        super().__init__(fmt, eager=eager, schemas=schemas)
        self._xml = Xml.OPEN
        self._name: list[str] = []  # the function or parameter name being read

    def _open_block(self, raw: str) -> None:
        super()._open_block(raw)
        self._name = []
        self._xml = Xml.FUNCTION_NAME if raw.endswith(FUNCTION) else Xml.OPEN

    def _block_char(self, ch: str) -> Outcome:
        state = self._xml
        if state is Xml.VALUE:
            if self._value_char(ch):
                self._xml = Xml.BODY
            return Outcome.CONSUMED
        if state is Xml.FUNCTION_NAME or state is Xml.PARAMETER_NAME:
            return self._name_char(ch)
        if self._partial == "" and ch in WHITESPACE:
            return Outcome.CONSUMED
        expected = {Xml.OPEN: (FUNCTION,), Xml.BODY: (PARAMETER, FUNCTION_END),
                    Xml.AFTER_FUNCTION: (BLOCK_END, FUNCTION)}[state]
        word = self._partial + ch
        if not any(literal.startswith(word) for literal in expected):
            return Outcome.LEAVE if state is Xml.AFTER_FUNCTION else self._broken()
        self._partial = word
        if word == FUNCTION:  # the literal stays in _partial with the name: text if the call breaks there
            self._xml, self._name = Xml.FUNCTION_NAME, []
        elif word == PARAMETER:
            self._xml, self._name = Xml.PARAMETER_NAME, []
        elif word == FUNCTION_END:
            self._end_function()
            self._xml = Xml.AFTER_FUNCTION
        elif word == BLOCK_END:
            self._partial, self._raw, self._in_block = "", [], False
        return Outcome.CONSUMED

    def _name_char(self, ch: str) -> Outcome:
        if ch != ">":
            if ch in NOT_IN_NAMES:
                return self._broken()
            self._name.append(ch)
            self._partial += ch
            return Outcome.CONSUMED
        if not self._name:
            return self._broken()
        name, self._partial = "".join(self._name), ""
        if self._xml is Xml.FUNCTION_NAME:
            self._begin_function(name)
            self._xml = Xml.BODY
        else:
            self._begin_parameter(name)
            self._xml = Xml.VALUE
        return Outcome.CONSUMED
