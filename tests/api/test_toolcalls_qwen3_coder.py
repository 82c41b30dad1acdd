"""The qwen3_coder format (Qwen3-Coder / Qwen3.5 XML calls): recognised from the real Qwen3-Coder chat
template (tests/helpers/templates/Qwen3-Coder.jinja) before hermes, its values typed by the tools'
schemas, read whole and streamed at every split, past calls rendered by that template."""

from __future__ import annotations

from typing import Any

import pytest

from server.protocol import ChatMessage
from server.toolcalls.output import Delta, ToolOutput
from server.toolcalls.parsers import FORMATS
from server.toolcalls.render import conversation
from server.toolcalls.xml_values import ValueType, convert, value_type
from tests.api.test_toolcalls_parsers import splits
from tests.helpers.tool_models import HERMES_TEMPLATE, QWEN3_CODER_TEMPLATE, TOOLS, tool_tokenizer
from tests.helpers.xml_calls import Calls, read_calls, read_whole, support

SCHEMAS: dict[str, Any] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]},
        "detailed": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object"}, "ratio": {"type": "number"}, "note": {"type": ["string", "null"]}},
        "required": ["city"]},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}
UNKNOWN_FORMAT = "{% for t in tools %}{{ t.function.name }} {% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call("get_weather", ("city", "Paris"), ("days", "3"))
CODE = 'def f(a, b):\n    return a < b and "x" != \'y\'\\n\n\n'  # a value with markup-like text, quotes, a blank end
# (model output, expected content, expected calls)
WELL_FORMED: list[tuple[str, str | None, Calls]] = [
    (PARIS, None, [("get_weather", {"city": "Paris", "days": 3})]),
    (f"I'll check both.\n\n{PARIS}\n{call('get_time', ('tz', 'UTC'))}", "I'll check both.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]),
    (call("get_weather", ("city", "New York"), ("unit", " f "), ("detailed", "True"), ("hours", "[9, 12]"),
          ("where", "{'lat': 40.7, 'lon': -74.0}"), ("ratio", "0.5"), ("note", "None")), None,
     [("get_weather", {"city": "New York", "unit": "f", "detailed": True, "hours": [9, 12],
                       "where": {"lat": 40.7, "lon": -74.0}, "ratio": 0.5, "note": None})]),
    (call("get_weather", ("city", "3"), ("days", "three"), ("detailed", "false"), ("extra", "42")), None,
     [("get_weather", {"city": "3", "days": "three", "detailed": False, "extra": "42"})]),  # strings stay text
    (call("write_file", ("path", "a.py"), ("content", CODE)), None,
     [("write_file", {"path": "a.py", "content": CODE})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>Oslo</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"city": "Oslo"})]),  # no newlines around the value: nothing to strip
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\nOslo\n\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "\nOslo\n"})]),  # exactly one newline is the format's, each side
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None, [("get_time", {})]),
    ("<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>", None, [("get_time", {"tz": "CET"})]),
    (PARIS.removesuffix("</tool_call>"), None, [("get_weather", {"city": "Paris", "days": 3})]),  # EOS early
    (f"{PARIS}\nDone: a <b> and <tool> here.", "Done: a <b> and <tool> here.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "<function=get_time>\n</function>\n</tool_call>", None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("If x < 3 then <function> is fine, and so is <tool_call without a close.", "If x < 3 then <function> is "
     "fine, and so is <tool_call without a close.", []),
]
MALFORMED = [
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # hermes JSON
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=>\nParis\n</parameter>\n</function>\n</tool_call>",
]


def run(pieces: list[str], eager: bool, cut_off: bool = False) -> tuple[str | None, Calls, list[dict]]:
    return read_calls("qwen3_coder", SCHEMAS, pieces, eager, cut_off)


def whole(text: str) -> tuple[str | None, Calls]:
    return read_whole("qwen3_coder", SCHEMAS, text)


def test_the_real_template_is_recognised_before_hermes() -> None:
    assert support(QWEN3_CODER_TEMPLATE).format.name == "qwen3_coder"
    assert support(HERMES_TEMPLATE).format.name == "hermes"  # Qwen2.5's JSON <tool_call> stays hermes
    assert support(UNKNOWN_FORMAT, "qwen3_coder").format.name == "qwen3_coder"
    assert support(QWEN3_CODER_TEMPLATE, "hermes").format.name == "hermes"
    assert "qwen3_coder" in support(UNKNOWN_FORMAT).reason


def test_value_types_from_schemas() -> None:
    assert value_type(None) == ValueType("string") and value_type({"type": "string"}).streams
    assert value_type({"type": ["integer", "null"]}) == ValueType("integer", nullable=True)
    assert value_type({"anyOf": [{"type": "null"}, {"type": "array"}]}) == ValueType("array", nullable=True)
    assert value_type({"type": "string", "enum": ["a"]}) == ValueType("string", choices=("a",))
    assert not value_type({"type": ["string", "null"]}).streams
    assert value_type({"enum": ["a", "b"]}) == ValueType("string", choices=("a", "b"))
    assert value_type({"enum": [1, "a", None]}) == ValueType("json", nullable=True)
    assert convert("1", value_type({"enum": [1, "a"]})) == 1 and convert("a", value_type({"enum": [1, "a"]})) == "a"
    cases = [("Paris", "string", "Paris"), (" 3 ", "integer", 3), ("3.5", "integer", "3.5"), ("-2e3", "number", -2000.0),
             ("true", "boolean", True), ("False", "boolean", False), ("yes", "boolean", "yes"),
             ('{"a": [1, null]}', "object", {"a": [1, None]}), ("{'a': (1, 2)}", "object", {"a": [1, 2]}),
             ("[1, 2]", "array", [1, 2]), ("[1, 2", "array", "[1, 2"), ("{1, 2}", "array", "{1, 2}"),
             ("null", "integer", None), ("null", "string", "null"), ("NaN", "number", "NaN"), ("7", "weird", 7)]
    for text, kind, expected in cases:
        assert convert(text, ValueType(kind)) == expected, (text, kind)
    assert convert("None", ValueType("string", nullable=True)) is None


@pytest.mark.parametrize(("text", "content", "calls"), WELL_FORMED)
def test_outputs_whole_and_streamed_at_every_split(text: str, content: str | None, calls: Calls) -> None:
    assert whole(text) == (content, calls)
    for pieces in splits(text, seed=len(text)):
        for eager in (True, False):
            got_content, got_calls, entries = run(pieces, eager)
            assert (got_content, got_calls) == (content, calls), (eager, pieces)
            starts = [e for e in entries if "id" in e]
            assert [e["index"] for e in starts] == list(range(len(calls)))
            assert all(e["type"] == "function" and e["function"]["arguments"] == "" for e in starts)
            assert all(set(e) == {"index", "function"} for e in entries if "id" not in e)


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_content(text: str) -> None:
    assert whole(text) == (text, [])
    for pieces in splits(text, seed=1)[::5]:
        assert run(pieces, eager=False)[:2] == (text, [])


def test_streamed_arguments_arrive_before_the_call_ends() -> None:
    out = ToolOutput(FORMATS["qwen3_coder"], eager=True, schemas=SCHEMAS)
    assert out.feed("Sure.\n<tool_") == [Delta(content="Sure.")]  # the marker's start is held
    first = out.feed("call>\n<function=get_weather>\n<parameter=city>\nSan Fr")
    assert [d.tool_call for d in first] == [
        {"index": 0, "id": first[0].tool_call["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "San Fr'}}]
    assert [d.tool_call for d in out.feed("ancisco\n</para")] == [{"index": 0, "function": {"arguments": "ancisco"}}]
    assert out.feed("meter>\n<parameter=days>\n1") == [Delta(tool_call={"index": 0, "function": {"arguments": '", "days": '}})]
    tail = out.feed("4\n</parameter>\n</function>\n</tool_call>") + out.finish()
    assert "".join(d.tool_call["function"]["arguments"] for d in tail) == "14}"
    assert out.finish_reason("stop") == "tool_calls"


def test_a_streamed_call_broken_between_parameters_is_closed_and_the_rest_is_content() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\noops </function>\n</tool_call>"
    content, calls, _ = run(list(text), eager=True)
    assert calls == [("get_weather", {"city": "Paris"})] and content == "oops </function>\n</tool_call>"
    assert whole(text) == (text, [])


def test_a_call_cut_off_by_max_tokens_is_never_content() -> None:
    text = "Sure.\n" + PARIS[: PARIS.index("Paris") + 3]
    for pieces in splits(text, seed=3)[::9]:
        assert run(pieces, eager=False, cut_off=True)[:2] == ("Sure.", [])
        out = ToolOutput(FORMATS["qwen3_coder"], eager=True, schemas=SCHEMAS)
        deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish("length")
        assert "".join(d.content for d in deltas if d.content) == "Sure."
        assert "".join(d.tool_call["function"]["arguments"] for d in deltas if d.tool_call) == '{"city": "Par'
    out = ToolOutput(FORMATS["qwen3_coder"], eager=False)
    assert out.message(PARIS + "\n<tool_", "length")[0] is None  # a next marker begun: dropped


def test_past_calls_are_rendered_by_the_template_as_parameters() -> None:
    tokenizer = tool_tokenizer(QWEN3_CODER_TEMPLATE)
    messages = [ChatMessage(role="user", content="Weather?"),
                ChatMessage.model_validate({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}),
                ChatMessage(role="tool", content="21 C", tool_call_id="call_1")]
    rendered = conversation(messages, support(QWEN3_CODER_TEMPLATE).format)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    prompt = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ("<|im_start|>assistant\nChecking.\n\n" + call("get_weather", ("city", "Paris"), ("days", "3"))) in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt and "<name>get_weather</name>" in prompt
    # what the template prints is what the reader reads back
    assert whole(call("get_weather", ("city", "Paris"), ("days", "3"))) == (None, [("get_weather", {"city": "Paris", "days": 3})])

