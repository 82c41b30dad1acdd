"""Qwen3-Coder / Qwen3.5 XML tool calls end to end: the real Qwen3-Coder chat template on the tiny
tokenizer, a FakeEngine emitting scripted XML calls, read through the openai SDK (chat, streamed and
not; Responses), the anthropic SDK (tool_use) and Ollama's /api/chat, with tool_choice required / a
named function generated under the XML grammar."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.api.test_toolcalls_api import accepts, calls_of, client_for, grammar_of, last_prompt, streamed
from tests.helpers.tool_models import QWEN3_CODER_TEMPLATE, scripted_engine, tool_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
TIME = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
CALLS = f"I'll check.\n{WEATHER}\n{TIME}<|end|>"
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
MARKUP = ("<tool_call>", "<function", "<parameter", "</")


def qwen_server(fake_server: Callable, script: str, tokens_per_step: int = 1) -> Any:
    srv = fake_server(scripted_engine(tool_tokenizer(QWEN3_CODER_TEMPLATE), script, tokens_per_step=tokens_per_step))
    assert srv.state.prompt.tools.format.name == "qwen3_coder"
    return srv


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400} | fields


def test_calls_whole_and_streamed_through_the_openai_sdk(fake_server) -> None:
    srv = qwen_server(fake_server, CALLS)
    client = client_for(srv)
    full = client.chat.completions.create(**request())
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check."
    assert calls_of(choice.message) == EXPECTED
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris", "days": 3}'
    prompt = last_prompt(srv)
    assert "<function>\n<name>get_weather</name>" in prompt and prompt.endswith("<|im_start|>assistant\n")

    final, chunks = streamed(client, **request())
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content == "I'll check."
    assert calls_of(final.choices[0].message) == EXPECTED
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content and any(m in d.content for m in MARKUP) for d in deltas)  # no markup leaks
    entries = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in entries if t.id is not None] == [
        (0, "get_weather", ""), (1, "get_time", "")]
    fragments = [t.function.arguments for t in entries if t.id is None and t.index == 0]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Paris", "days": 3}'  # the value in pieces


def test_tool_choice_required_is_generated_under_the_xml_grammar(fake_server) -> None:
    srv = qwen_server(fake_server, TIME + "<|end|>", tokens_per_step=4)
    client = client_for(srv)
    full = client.chat.completions.create(**request(tool_choice="required"))
    assert full.choices[0].message.content is None and calls_of(full.choices[0].message) == [("get_time", {"tz": "UTC"})]
    assert last_prompt(srv).endswith("<|im_start|>assistant\n")  # nothing prefilled: the grammar writes the call
    spec, compiled = grammar_of(srv)
    assert '"style": "qwen_xml"' in spec.spec
    assert accepts(compiled, TIME) and accepts(compiled, f"{WEATHER}\n{TIME}")
    assert accepts(compiled, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")  # as the template prints {}
    assert not accepts(compiled, "It is noon.")
    assert not accepts(compiled, WEATHER.replace("\n3\n", "\nthree\n"))  # days is an integer
    assert not accepts(compiled, TIME.replace("get_time", "get_date"))
    assert not accepts(compiled, WEATHER.replace("<parameter=city>\nParis\n</parameter>\n", ""))  # city is required
    assert not accepts(compiled, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    final, _ = streamed(client, **request(tool_choice="required"))
    assert calls_of(final.choices[0].message) == [("get_time", {"tz": "UTC"})]


def test_named_tool_choice_allows_one_call_of_that_function(fake_server) -> None:
    srv = qwen_server(fake_server, WEATHER + "<|end|>", tokens_per_step=4)
    client = client_for(srv)
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(**request(tool_choice=named))
    assert calls_of(full.choices[0].message) == [EXPECTED[0]]
    spec, compiled = grammar_of(srv)
    assert "get_time" not in spec.spec
    assert accepts(compiled, WEATHER) and not accepts(compiled, f"{WEATHER}\n{WEATHER}") and not accepts(compiled, TIME)
    assert calls_of(streamed(client, **request(tool_choice=named))[0].choices[0].message) == [EXPECTED[0]]


def test_auto_lets_text_through_and_puts_calls_under_the_grammar(fake_server) -> None:
    srv = qwen_server(fake_server, CALLS, tokens_per_step=4)
    client_for(srv).chat.completions.create(**request())
    _, compiled = grammar_of(srv)
    assert accepts(compiled, CALLS.removesuffix("<|end|>")) and accepts(compiled, "It is sunny, x < y.")
    assert not accepts(compiled, "Sure.\n" + WEATHER.replace("\n3\n", "\nthree\n"))
    assert not accepts(compiled, "Sure.\n<function=get_time>\n</function>")  # no call outside <tool_call>


def test_past_calls_and_results_are_rendered_as_the_template_prints_them(fake_server) -> None:
    srv = qwen_server(fake_server, "It is 21 degrees in Paris.<|end|>", tokens_per_step=4)
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 C, sunny"}]
    full = client_for(srv).chat.completions.create(**request(messages=messages))
    assert full.choices[0].message.content == "It is 21 degrees in Paris."
    prompt = last_prompt(srv)
    assert "<|im_start|>assistant\n" + WEATHER + "<|im_end|>" in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt
    messages[1]["tool_calls"][0]["function"]["arguments"] = "not json"  # the template needs an object
    with pytest.raises(openai.BadRequestError) as info:
        client_for(srv).chat.completions.create(**request(messages=messages))
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_anthropic_sdk_gets_tool_use_blocks(fake_server) -> None:
    srv = qwen_server(fake_server, CALLS, tokens_per_step=3)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = client.messages.create(model="fake-model", max_tokens=400, messages=MESSAGES, tools=tools)
    assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
    assert message.stop_reason == "tool_use" and message.content[0].text == "I'll check."
    assert [(b.name, b.input) for b in message.content[1:]] == EXPECTED
    with client.messages.stream(model="fake-model", max_tokens=400, messages=MESSAGES, tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == EXPECTED
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == "I'll check."


def test_ollama_chat_and_responses_get_typed_calls(fake_server) -> None:
    srv = qwen_server(fake_server, CALLS, tokens_per_step=3)
    body = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "stream": False, "options": {"num_predict": 400}}
    reply = httpx.post(srv.url + "/api/chat", json=body, timeout=30).json()
    assert reply["message"]["content"] == "I'll check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply["message"]["tool_calls"]] == EXPECTED
    response = client_for(srv).responses.create(model="fake-model", input="Weather in Paris?", max_output_tokens=400,
                                                tools=[{"type": "function", **t["function"]} for t in TOOLS])
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED and response.output_text == "I'll check."


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_tool_parser_flag_picks_the_reader(fake_server, parser: str) -> None:
    srv = fake_server(scripted_engine(tool_tokenizer(QWEN3_CODER_TEMPLATE), CALLS, tokens_per_step=4), tool_parser=parser)
    message = client_for(srv).chat.completions.create(**request()).choices[0].message
    if parser == "qwen3_coder":
        assert calls_of(message) == EXPECTED
    else:  # read as hermes JSON, the XML calls are not calls: they stay text
        assert message.tool_calls is None and "<function=get_weather>" in message.content
    with pytest.raises(openai.BadRequestError):
        client_for(srv).chat.completions.create(**request(tool_choice={"type": "function", "function": {"name": "x"}}))
