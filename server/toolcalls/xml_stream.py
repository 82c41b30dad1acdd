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

`XmlCallReader` is the JSON reader of server/toolcalls/stream.py (text outside blocks, markers held
across pieces, whitespace around calls dropped, malformed markup kept as content) with the inside of
a block read here, a character at a time. Its events are the same: `("start", index, name)`, then
`("args", index, fragment)`s that concatenate to the call's arguments as a JSON object in text,
`{"city": "Paris", "days": 3}` (", " and ": " as `json.dumps` writes them). Each value is converted
to its parameter's type in the tool's schema (server/toolcalls/xml_values.py); one newline right
after `<parameter=k>` and one right before `</parameter>` are the format's, not the value's.

Whole (`eager=False`) a call is committed at its `</function>`: until then its events are held, and a
call broken anywhere is content. Streamed (`eager=True`) it is committed at `<function=name>`: `{` is
sent then, each key when its `<parameter=k>` is complete, a string value piece by piece as it
arrives (all but a tail that may begin `\\n</parameter>`), any other value when its `</parameter>`
comes, and `}` at `</function>`. A committed call broken between parameters is closed there (`}`,
so its arguments stay JSON) and the text from the bad character on is content. A value ends at the
first `</parameter>` (the call grammar keeps that text out of values). `<function=` without
`<tool_call>` before it opens a call too (vLLM reads such output as a call).
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from server.toolcalls.call import Event
from server.toolcalls.parsers import ToolFormat
from server.toolcalls.stream import WHITESPACE, Outcome, ToolCallReader
from server.toolcalls.xml_values import ValueType, convert, value_type

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
BLOCK_END = "</tool_call>"
VALUE_ENDS = ("\n" + PARAMETER_END, PARAMETER_END)  # what may follow a value: held until it is known
NOT_IN_NAMES = frozenset(WHITESPACE + "<>=\"'")


class Xml(Enum):
    OPEN = "open"  # after <tool_call>: "<function=" comes
    FUNCTION_NAME = "function_name"  # after "<function=", until ">"
    BODY = "body"  # inside <function=f>: "<parameter=" or "</function>" comes
    PARAMETER_NAME = "parameter_name"  # after "<parameter=", until ">"
    VALUE = "value"  # a parameter's text, until "</parameter>"
    AFTER_FUNCTION = "after_function"  # "</tool_call>" or another "<function=" comes


class XmlCall:
    """One call being read: its name, the parameters' types, and its events until it is committed."""

    def __init__(self, index: int, name: str, schema: Any):
        self.index = index
        self.name = name
        self.properties = schema.get("properties") if isinstance(schema, dict) else None
        self.committed = False
        self.held: list[Event] = []  # events before the commit
        self.num_params = 0
        self.vtype = ValueType("string")  # the current parameter's
        self.value: list[str] = []  # the current value's text, less its tail
        self.tail = ""  # the value's last characters while they may begin "\n</parameter>"
        self.first = True  # no character of the current value read yet


class XmlCallReader(ToolCallReader):
    def __init__(self, fmt: ToolFormat, *, eager: bool, schemas: dict[str, Any] | None = None):
        super().__init__(fmt, eager=eager)
        self.schemas = schemas or {}  # tool name -> its `parameters` schema
        self._xml = Xml.OPEN
        self._name: list[str] = []  # the function or parameter name being read
        self._xcall: XmlCall | None = None

    # -- the block: ToolCallReader's hooks ------------------------------------------------

    def _open_block(self, raw: str) -> None:
        super()._open_block(raw)
        self._name = []
        self._xml = Xml.FUNCTION_NAME if raw.endswith(FUNCTION) else Xml.OPEN

    def _block_char(self, ch: str) -> Outcome:
        state = self._xml
        if state is Xml.VALUE:
            self._value_char(ch)
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
        elif word == BLOCK_END:
            self._partial, self._raw, self._in_block = "", [], False
        return Outcome.CONSUMED

    def _end_of_output(self) -> None:
        """The output ended inside a block (cut off): a committed call keeps what was sent, a call
        not committed is dropped; the markup is never content."""
        super()._end_of_output()
        self._xcall = None

    # -- names, values and calls ----------------------------------------------------------

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
        else:
            self._begin_parameter(name)
        return Outcome.CONSUMED

    def _begin_function(self, name: str) -> None:
        self._xcall = XmlCall(self.num_calls, name, self.schemas.get(name))
        self._xml = Xml.BODY
        if self.eager:
            self._commit()
        self._emit("{")

    def _begin_parameter(self, name: str) -> None:
        call = self._xcall
        assert call is not None
        properties = call.properties if isinstance(call.properties, dict) else {}
        call.vtype = value_type(properties.get(name))
        call.value, call.tail, call.first = [], "", True
        self._emit(("" if call.num_params == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": ")
        if call.vtype.streams:
            self._emit('"')
        call.num_params += 1
        self._xml = Xml.VALUE

    def _value_char(self, ch: str) -> None:
        call = self._xcall
        assert call is not None
        if call.first:
            call.first = False
            if ch == "\n":  # the format's newline after <parameter=k>
                return
        tail = call.tail + ch
        if tail.endswith(PARAMETER_END):
            text = tail[: -len(PARAMETER_END)]
            self._take_value(call, text.removesuffix("\n"))
            self._end_value(call)
            return
        keep = max((n for n in range(min(len(tail), len(VALUE_ENDS[0])), 0, -1)
                    if any(end.startswith(tail[-n:]) for end in VALUE_ENDS)), default=0)
        self._take_value(call, tail[: len(tail) - keep])
        call.tail = tail[len(tail) - keep:]

    def _take_value(self, call: XmlCall, text: str) -> None:
        if not text:
            return
        call.value.append(text)
        if call.vtype.streams:
            self._emit(json.dumps(text, ensure_ascii=False)[1:-1])

    def _end_value(self, call: XmlCall) -> None:
        if call.vtype.streams:
            self._emit('"')
        else:
            self._emit(json.dumps(convert("".join(call.value), call.vtype), ensure_ascii=False))
        call.value, call.tail = [], ""
        self._xml = Xml.BODY

    def _end_function(self) -> None:
        call = self._xcall
        assert call is not None
        self._emit("}")
        if not call.committed:
            self._commit()
        self._xcall, self._partial, self._raw = None, "", []
        self._xml = Xml.AFTER_FUNCTION

    def _commit(self) -> None:
        call = self._xcall
        assert call is not None
        call.committed = True
        self.num_calls += 1
        self._push(("start", call.index, call.name))
        for event in call.held:
            self._push(event)
        call.held = []

    def _emit(self, fragment: str) -> None:
        call = self._xcall
        assert call is not None
        if call.committed:
            self._push(("args", call.index, fragment))
        else:
            call.held.append(("args", call.index, fragment))

    def _broken(self) -> Outcome:
        """A character the markup does not allow: a call not committed is content (the character read
        again as text); a committed one is closed where it broke, and the rest is text."""
        call = self._xcall
        if call is None or not call.committed:
            self._xcall = None
            return Outcome.FAIL
        self._emit("}")
        self._xcall = None
        return Outcome.BREAK
