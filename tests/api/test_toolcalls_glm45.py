"""The glm45 format (GLM-4.5 / 4.6 / 4.7 `<arg_key>`/`<arg_value>` calls): recognised from the real GLM-4.6
chat template (tests/helpers/templates/GLM-4.6.jinja) before hermes, its values typed by the tools'
schemas, read whole and streamed at every split, past calls rendered by that template, and the
glm_xml grammar walked over a call's tokens read back as the same call."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar

from engine.speculation.grammar import GrammarCache
from server.protocol import ChatCompletionRequest, ChatMessage
from server.toolcalls.detect import ToolSupport
from server.toolcalls.output import Delta, ToolOutput
from server.toolcalls.parsers import FORMATS
from server.toolcalls.plan import plan_tools
from server.toolcalls.render import conversation
from tests.api.test_toolcalls_parsers import splits
from tests.api.test_toolcalls_qwen3_coder import SCHEMAS, UNKNOWN_FORMAT
from tests.helpers.tool_models import (
    GLM45_TEMPLATE,
    HERMES_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    TOOLS,
    tool_tokenizer,
)
from tests.helpers.xml_calls import Calls, read_calls, read_whole, support


def call(name: str, *params: tuple[str, str], sep: str = "\n") -> str:
    """A call as GLM-4.5's template prints it (`sep` "": as GLM-4.7's)."""
    body = "".join(f"<arg_key>{key}</arg_key>{sep}<arg_value>{value}</arg_value>{sep}" for key, value in params)
    return f"<tool_call>{name}{sep}{body}</tool_call>"


PARIS = call("get_weather", ("city", "Paris"), ("days", "3"))
CODE = 'def f(a, b):\n    return a < b and "x" != \'y\'\\n\n\n'  # a value with markup-like text, quotes, a blank end
# (model output, expected content, expected calls)
WELL_FORMED: list[tuple[str, str | None, Calls]] = [
    (PARIS, None, [("get_weather", {"city": "Paris", "days": 3})]),
    (call("get_weather", ("city", "Paris"), ("days", "3"), sep=""), None, [("get_weather", {"city": "Paris", "days": 3})]),
    (f"I'll check both.\n\n{PARIS}\n{call('get_time', ('tz', 'UTC'))}", "I'll check both.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]),
    (call("get_weather", ("city", "New York"), ("unit", " f "), ("detailed", "true"), ("hours", "[9, 12]"),
          ("where", '{"lat": 40.7, "lon": -74.0}'), ("ratio", " 0.5\n"), ("note", "null")), None,
     [("get_weather", {"city": "New York", "unit": "f", "detailed": True, "hours": [9, 12],
                       "where": {"lat": 40.7, "lon": -74.0}, "ratio": 0.5, "note": None})]),
    (call("get_weather", ("city", "3"), ("days", "three"), ("detailed", "false"), ("extra", "42")), None,
     [("get_weather", {"city": "3", "days": "three", "detailed": False, "extra": "42"})]),  # strings stay text
    (call("write_file", ("path", "a.py"), ("content", CODE)), None, [("write_file", {"path": "a.py", "content": CODE})]),
    (call("get_weather", ("city", "\nOslo\n")), None, [("get_weather", {"city": "\nOslo\n"})]),  # raw: nothing stripped
    ("<tool_call>get_weather \n\t<arg_key> city </arg_key>  \n<arg_value>Rome</arg_value>  \n </tool_call>", None,
     [("get_weather", {"city": "Rome"})]),  # whitespace between the markup
    ("<tool_call>\nget_time\n</tool_call>", None, [("get_time", {})]),
    ("<tool_call>get_time</tool_call>", None, [("get_time", {})]),
    (PARIS.removesuffix("</tool_call>"), None, [("get_weather", {"city": "Paris", "days": 3})]),  # EOS early
    (f"{PARIS}\nDone: a <b> and <tool> here.", "Done: a <b> and <tool> here.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("If x < 3 then <arg_key> is fine, and so is <tool_call without a close.",
     "If x < 3 then <arg_key> is fine, and so is <tool_call without a close.", []),
]
MALFORMED = [
    "<tool_call>get_weather(city='Paris')\n</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # hermes JSON
    "<tool_call>get weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "<tool_call>get_weather\nParis\n</tool_call>",
    "<tool_call>get_weather\n<arg_key></arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis</arg_value>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",  # Qwen's XML
]


def run(pieces: list[str], eager: bool, cut_off: bool = False) -> tuple[str | None, Calls, list[dict]]:
    return read_calls("glm45", SCHEMAS, pieces, eager, cut_off)


def whole(text: str) -> tuple[str | None, Calls]:
    return read_whole("glm45", SCHEMAS, text)


def test_the_real_template_is_recognised_before_hermes() -> None:
    assert support(GLM45_TEMPLATE).format.name == "glm45"
    assert support(HERMES_TEMPLATE).format.name == "hermes"
    assert support(QWEN3_CODER_TEMPLATE).format.name == "qwen3_coder"
    assert support(UNKNOWN_FORMAT, "glm45").format.name == "glm45"
    assert support(GLM45_TEMPLATE, "hermes").format.name == "hermes"
    assert "glm45" in support(UNKNOWN_FORMAT).reason


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


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_content(text: str) -> None:
    assert whole(text) == (text, [])
    for pieces in splits(text, seed=1)[::5]:
        assert run(pieces, eager=False)[:2] == (text, [])


def test_streamed_arguments_arrive_before_the_call_ends() -> None:
    out = ToolOutput(FORMATS["glm45"], eager=True, schemas=SCHEMAS)
    assert out.feed("Sure.\n<tool_") == [Delta(content="Sure.")]  # the marker's start is held
    assert out.feed("call>get_weather\n") == []  # the name is known at the first <arg_key>
    first = out.feed("<arg_key>city</arg_key>\n<arg_value>San Fr")
    assert [d.tool_call for d in first] == [
        {"index": 0, "id": first[0].tool_call["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "San Fr'}}]
    assert [d.tool_call for d in out.feed("ancisco</arg_va")] == [{"index": 0, "function": {"arguments": "ancisco"}}]
    assert out.feed("lue>\n<arg_key>days</arg_key>\n<arg_value>1") == [
        Delta(tool_call={"index": 0, "function": {"arguments": '", "days": '}})]
    tail = out.feed("4</arg_value>\n</tool_call>") + out.finish()
    assert "".join(d.tool_call["function"]["arguments"] for d in tail) == "14}"
    assert out.finish_reason("stop") == "tool_calls"


def test_a_streamed_call_broken_between_arguments_is_closed_and_the_rest_is_content() -> None:
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\noops </tool_call>"
    content, calls, _ = run(list(text), eager=True)
    assert calls == [("get_weather", {"city": "Paris"})] and content == "oops </tool_call>"
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value><arg_key>days</arg_key>3"
    content, calls, _ = run(list(text), eager=True)  # broken before <arg_value>: the key is not sent
    assert calls == [("get_weather", {"city": "Paris"})] and content == "<arg_key>days</arg_key>3"
    assert whole(text) == (text, [])


def test_a_call_cut_off_by_max_tokens_is_never_content() -> None:
    text = "Sure.\n" + PARIS[: PARIS.index("Paris") + 3]
    for pieces in splits(text, seed=3)[::9]:
        assert run(pieces, eager=False, cut_off=True)[:2] == ("Sure.", [])
        out = ToolOutput(FORMATS["glm45"], eager=True, schemas=SCHEMAS)
        deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish("length")
        assert "".join(d.content for d in deltas if d.content) == "Sure."
        assert "".join(d.tool_call["function"]["arguments"] for d in deltas if d.tool_call) == '{"city": "Par'


def test_past_calls_are_rendered_by_the_template_as_key_value_pairs() -> None:
    tokenizer = tool_tokenizer(GLM45_TEMPLATE)
    args = {"city": "Paris", "days": 3, "hours": [9, 12], "detailed": True}
    messages = [ChatMessage(role="user", content="Weather?"),
                ChatMessage.model_validate({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps(args)}}]}),
                ChatMessage(role="tool", content="21 C", tool_call_id="call_1")]
    rendered = conversation(messages, support(GLM45_TEMPLATE).format)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == args
    prompt = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    printed = call("get_weather", ("city", "Paris"), ("days", "3"), ("hours", "[9, 12]"), ("detailed", "true"))
    assert "<|assistant|>\n<think></think>\nChecking.\n" + printed + "<|observation|>" in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
    assert whole(printed) == (None, [("get_weather", args)])  # what the template prints is what the reader reads back


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("sep", ["\n", "", " \n\t"])
def test_the_grammar_takes_a_calls_tokens_and_the_reader_reads_them_back(special: bool, sep: str) -> None:
    markers = FORMATS["glm45"].special_tokens if special else ()
    tokenizer = tool_tokenizer(GLM45_TEMPLATE, markers)
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
    text = call("get_weather", ("city", " New\nYork "), ("days", "3"), ("hours", "[9, 12]"), ("note", "null"), sep=sep)
    expected = [("get_weather", {"city": " New\nYork ", "days": 3, "hours": [9, 12], "note": None})]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": tools, "tool_choice": choice})
        plan = plan_tools(ToolSupport.detect(tokenizer, GLM45_TEMPLATE, "auto"), request)
        assert plan is not None and '"style": "glm_xml"' in plan.grammar.spec
        compiled = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(plan.grammar)

        def accepts(output: str, compiled: Any = compiled) -> bool:
            matcher = xgrammar.GrammarMatcher(compiled)
            ids = tokenizer.encode(output, add_special_tokens=False)
            return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)

        ids = tokenizer.encode(text, add_special_tokens=False)
        assert special == any(tokenizer.convert_ids_to_tokens(t) == "<arg_key>" for t in ids)
        assert accepts(text), choice
        assert plan.output(eager=False).message(tokenizer.decode(ids))[1] is not None
        assert whole(tokenizer.decode(ids)) == (None, expected)
        assert not accepts(text.replace("get_weather", "get_wether"))  # no such tool
        assert not accepts(text.replace("<arg_value>3<", "<arg_value>three<"))  # days is an integer
        assert not accepts(call("get_weather", ("days", "3")))  # city is required
        assert not accepts(call("get_weather", ("city", "Paris"), ("town", "Paris")))  # no such property
        assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
        assert accepts("It is sunny.") == (choice == "auto")
