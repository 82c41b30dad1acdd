"""What the readers of XML-like tool calls share: one call's arguments, its values typed by the tool's
schema (server/toolcalls/xml_values.py), and when its events are sent.

`XmlArgsReader` is the JSON reader of server/toolcalls/stream.py (text outside blocks, markers held
across pieces, whitespace around calls dropped, malformed markup kept as content) with the inside of
a block left to a subclass, which reads the markup of its format a character at a time and calls
`_begin_function`, `_begin_parameter`, `_value_char` (until it returns True) and `_end_function`:
- server/toolcalls/xml_stream.py: Qwen's `<function=f><parameter=k>\\nvalue\\n</parameter></function>`;
- server/toolcalls/glm_stream.py: GLM's `<tool_call>f<arg_key>k</arg_key><arg_value>value</arg_value></tool_call>`.

The events are the JSON reader's: `("start", index, name)`, then `("args", index, fragment)`s that
concatenate to the call's arguments as a JSON object in text, `{"city": "Paris", "days": 3}` (", "
and ": " as `json.dumps` writes them). Whole (`eager=False`) a call is committed at its end: until
then its events are held, and a call broken anywhere is content. Streamed (`eager=True`) it is
committed once its name is read: `{` is sent then, each key when it is complete, a string value piece
by piece as it arrives (all but a tail that may begin its end), any other value at its end, and `}`
at the call's end. A committed call broken between parameters is closed there (`}`, so its arguments
stay JSON) and the text from the bad character on is content. A value ends at the first `value_end`
(the call grammar keeps that text out of values).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from server.toolcalls.call import Event
from server.toolcalls.parsers import ToolFormat
from server.toolcalls.stream import Outcome, ToolCallReader
from server.toolcalls.xml_values import ValueType, convert, value_type


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
        self.tail = ""  # the value's last characters while they may begin its end
        self.first = True  # no character of the current value read yet


class XmlArgsReader(ToolCallReader):
    value_end: ClassVar[str]  # closes a value: "</parameter>"
    trim_newlines: ClassVar[bool]  # one newline right after the value's opening and right before its end is markup

    def __init__(self, fmt: ToolFormat, *, eager: bool, schemas: dict[str, Any] | None = None):
        super().__init__(fmt, eager=eager)
        self.schemas = schemas or {}  # tool name -> its `parameters` schema
        self._xcall: XmlCall | None = None
        # what may follow a value, held until it is known
        self._value_ends = ("\n" + self.value_end, self.value_end) if self.trim_newlines else (self.value_end,)

    def _end_of_output(self) -> None:
        """The output ended inside a block (cut off): a committed call keeps what was sent, a call
        not committed is dropped; the markup is never content."""
        super()._end_of_output()
        self._xcall = None

    def _begin_function(self, name: str) -> None:
        self._xcall = XmlCall(self.num_calls, name, self.schemas.get(name))
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

    def _value_char(self, ch: str) -> bool:
        """Read one character of a value; True when it closed the value."""
        call = self._xcall
        assert call is not None
        if call.first:
            call.first = False
            if ch == "\n" and self.trim_newlines:  # the format's newline after the opening
                return False
        tail = call.tail + ch
        if tail.endswith(self.value_end):
            text = tail[: -len(self.value_end)]
            self._take_value(call, text.removesuffix("\n") if self.trim_newlines else text)
            self._end_value(call)
            return True
        keep = max((n for n in range(min(len(tail), len(self._value_ends[0])), 0, -1)
                    if any(end.startswith(tail[-n:]) for end in self._value_ends)), default=0)
        self._take_value(call, tail[: len(tail) - keep])
        call.tail = tail[len(tail) - keep:]
        return False

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

    def _end_function(self) -> None:
        call = self._xcall
        assert call is not None
        self._emit("}")
        if not call.committed:
            self._commit()
        self._xcall, self._partial, self._raw = None, "", []

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
