"""Which tool-call format a chat template gets, how messages and tools are rendered for it, how a
request's tool_choice is planned, and marker tokens kept through detokenization."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.types import ConfigError
from server.config import ServerConfig
from server.detok import TextStream
from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage
from server.serve import add_server_arguments, server_config_from
from server.toolcalls.detect import ToolSupport
from server.toolcalls.plan import plan_tools
from server.toolcalls.render import arguments_object, conversation, mistral_id
from tests.helpers.fake_engine import tiny_tokenizer
from tests.helpers.tool_models import HERMES_TEMPLATE, LLAMA_TEMPLATE, MISTRAL_TEMPLATE, TOOLS, tool_tokenizer

BUILTIN_TEMPLATE = (Path(__file__).resolve().parents[2] / "models/default/target/chat_template.jinja").read_text()
IGNORES_TOOLS = "{% if tools %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
RAISES_ON_TOOLS = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0].content }}"
UNKNOWN_FORMAT = "{% for t in tools %}{{ t.function.name }} {% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"


def support(template: str, tool_parser: str = "auto", special: tuple[str, ...] = ()) -> ToolSupport:
    return ToolSupport.detect(tool_tokenizer(template, special), template, tool_parser)


@pytest.mark.parametrize(("template", "special", "name"), [
    (HERMES_TEMPLATE, (), "hermes"),
    (LLAMA_TEMPLATE, (), "llama3_json"),
    (LLAMA_TEMPLATE, ("<|python_tag|>",), "llama3_json"),
    (MISTRAL_TEMPLATE, ("[TOOL_CALLS]", "[ARGS]"), "mistral"),
    (UNKNOWN_FORMAT, ("<tool_call>", "</tool_call>"), "hermes"),  # known from the tokenizer's tokens
])
def test_formats_are_recognised(template: str, special: tuple[str, ...], name: str) -> None:
    found = support(template, special=special)
    assert found.format is not None and found.format.name == name and found.reason == ""


@pytest.mark.parametrize(("template", "reason"), [
    (BUILTIN_TEMPLATE, "never reads `tools`"),
    (IGNORES_TOOLS, "does not appear in the prompt"),
    (RAISES_ON_TOOLS, "no tools here"),
    (UNKNOWN_FORMAT, "--tool-parser"),
])
def test_templates_that_cannot_call_tools(template: str, reason: str) -> None:
    found = support(template)
    assert found.format is None and reason in found.reason and found.drop_ids is None


def test_tool_parser_flag() -> None:
    assert support(UNKNOWN_FORMAT, "mistral").format.name == "mistral"
    assert support(HERMES_TEMPLATE, "llama3_json").format.name == "llama3_json"
    off = support(HERMES_TEMPLATE, "none")
    assert off.format is None and "--tool-parser none" in off.reason
    assert support(BUILTIN_TEMPLATE, "hermes").format is None  # a template that renders no tools stays off


def test_special_marker_tokens_survive_detokenization() -> None:
    assert support(HERMES_TEMPLATE).drop_ids is None  # plain text markers: ordinary decoding keeps them
    tokenizer = tool_tokenizer(MISTRAL_TEMPLATE, ("[TOOL_CALLS]", "[ARGS]"))
    drop = ToolSupport.detect(tokenizer, MISTRAL_TEMPLATE, "auto").drop_ids
    markers = {tokenizer.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[ARGS]")}
    assert drop is not None and not markers & drop and tokenizer.eos_token_id in drop
    ids = tokenizer.encode("<|bos|>ok [TOOL_CALLS]f[ARGS]{}<|pad|>", add_special_tokens=False)
    plain, kept = TextStream(tokenizer), TextStream(tokenizer, drop_ids=drop)
    assert plain.feed(ids) + plain.finish() == "ok f{}"
    assert kept.feed(ids) + kept.finish() == "ok [TOOL_CALLS]f[ARGS]{}"


def test_conversation_for_templates() -> None:
    messages = [
        ChatMessage(role="user", content="hi", name="ann"),
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}),
        ChatMessage(role="tool", content="42", tool_call_id="call_1"),
    ]
    plain = conversation(messages, None)
    assert plain[0] == {"role": "user", "content": "hi", "name": "ann"}
    assert plain[1]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                         "function": {"name": "f", "arguments": {"a": [1, 2]}}}
    assert plain[1]["tool_calls"][1]["function"]["arguments"] == "not json" and plain[1]["content"] == ""
    assert plain[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert "tool_calls" not in plain[0] and "tool_call_id" not in plain[0]
    short = conversation(messages, support(MISTRAL_TEMPLATE, special=("[TOOL_CALLS]",)).format)
    assert short[1]["tool_calls"][0]["id"] == short[2]["tool_call_id"] == mistral_id("call_1")
    assert len(mistral_id("call_1")) == 9 and mistral_id("abcDEF123") == "abcDEF123"
    assert arguments_object({"x": 1}) == {"x": 1} and arguments_object("[1]") == "[1]"


def request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS} | fields
    return ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))


def test_plans() -> None:
    hermes = support(HERMES_TEMPLATE)
    assert plan_tools(hermes, request(tools=None)) is None
    assert plan_tools(hermes, request(tool_choice="none")) is None
    auto = plan_tools(hermes, request())
    assert auto is not None and auto.max_calls is None and auto.tools == TOOLS
    assert auto.grammar.kind == "structural_tag" and '"triggered_tags"' in auto.grammar.spec
    assert plan_tools(hermes, request(parallel_tool_calls=False)).max_calls == 1
    required = plan_tools(hermes, request(tool_choice="required")).grammar.spec
    assert '"at_least_one": true' in required and "get_time" in required and "get_weather" in required
    named = plan_tools(hermes, request(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.max_calls == 1 and "get_weather" not in named.grammar.spec
    off = ToolSupport.detect(tiny_tokenizer(), BUILTIN_TEMPLATE, "auto")
    assert plan_tools(off, request()) is None and plan_tools(off, request(tool_choice="auto")) is None
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(APIError) as info:
            plan_tools(off, request(tool_choice=choice))
        assert info.value.status == 400 and info.value.param == "tool_choice"


def test_tool_parser_flag_and_config_key() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_config_from(parser.parse_args(["--tool-parser", "mistral"]), None).tool_parser == "mistral"
    assert server_config_from(parser.parse_args([]), {"tool_parser": "none"}).tool_parser == "none"
    assert ServerConfig().tool_parser == "auto"
    with pytest.raises(ConfigError, match="server.tool_parser"):
        ServerConfig(tool_parser="qwen")
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-parser", "qwen"])
