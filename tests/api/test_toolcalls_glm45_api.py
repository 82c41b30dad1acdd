"""GLM-4.5 / 4.6 / 4.7 tool calls end to end: the real GLM-4.6 chat template on the tiny tokenizer, a
FakeEngine emitting scripted `<arg_key>`/`<arg_value>` calls, read through the openai SDK (streamed and
not) and the anthropic SDK (tool_use), tool_choice required / a named function generated under the
glm_xml grammar, and a follow-up replaying the call and its result through the template."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.api.test_toolcalls_api import accepts, calls_of, client_for, grammar_of, last_prompt, streamed
from tests.api.test_toolcalls_qwen3_coder_api import TOOLS
from tests.helpers.tool_models import GLM45_TEMPLATE, scripted_engine, tool_tokenizer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
TIME = "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"  # GLM-4.7: no newlines
CALLS = f"I'll check.\n{WEATHER}\n{TIME}<|end|>"
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
MARKUP = ("<tool_call>", "<arg_", "</arg_", "</tool_call>")


def glm_server(fake_server: Callable, script: str, tokens_per_step: int = 1, **kwargs: Any) -> Any:
    srv = fake_server(scripted_engine(tool_tokenizer(GLM45_TEMPLATE), script, tokens_per_step=tokens_per_step), **kwargs)
    assert srv.state.prompt.tools.format.name == kwargs.get("tool_parser", "glm45")
    return srv


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400} | fields


def test_calls_whole_and_streamed_through_the_openai_sdk(fake_server) -> None:
    srv = glm_server(fake_server, CALLS)
    client = client_for(srv)
    choice = client.chat.completions.create(**request()).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check."
    assert calls_of(choice.message) == EXPECTED
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris", "days": 3}'
    prompt = last_prompt(srv)
    assert '"name": "get_weather"' in prompt and prompt.endswith("<|assistant|>")

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


def test_tool_choice_required_and_named_are_generated_under_the_glm_grammar(fake_server) -> None:
    srv = glm_server(fake_server, WEATHER + "<|end|>", tokens_per_step=4)
    client = client_for(srv)
    full = client.chat.completions.create(**request(tool_choice="required"))
    assert full.choices[0].message.content is None and calls_of(full.choices[0].message) == [EXPECTED[0]]
    spec, compiled = grammar_of(srv)
    assert '"style": "glm_xml"' in spec.spec
    assert accepts(compiled, WEATHER) and accepts(compiled, f"{WEATHER}\n{TIME}")
    assert accepts(compiled, "<tool_call>get_time\n</tool_call>")  # as the template prints {}
    assert not accepts(compiled, "It is noon.")
    assert not accepts(compiled, WEATHER.replace(">3<", ">three<"))  # days is an integer
    assert not accepts(compiled, TIME.replace("get_time", "get_date"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert calls_of(streamed(client, **request(tool_choice=named))[0].choices[0].message) == [EXPECTED[0]]
    spec, compiled = grammar_of(srv)
    assert "get_time" not in spec.spec
    assert accepts(compiled, WEATHER) and not accepts(compiled, f"{WEATHER}\n{WEATHER}") and not accepts(compiled, TIME)


def test_a_follow_up_replays_the_call_and_its_result_through_the_template(fake_server) -> None:
    srv = glm_server(fake_server, "It is 21 degrees in Paris.<|end|>", tokens_per_step=4)
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 C, sunny"}]
    full = client_for(srv).chat.completions.create(**request(messages=messages))
    assert full.choices[0].message.content == "It is 21 degrees in Paris."
    prompt = last_prompt(srv)
    assert "<|assistant|>\n<think></think>\n" + WEATHER + "<|observation|>" in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response><|assistant|>" in prompt
    messages[1]["tool_calls"][0]["function"]["arguments"] = "not json"  # the template needs an object
    with pytest.raises(openai.BadRequestError) as info:
        client_for(srv).chat.completions.create(**request(messages=messages))
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_anthropic_sdk_gets_tool_use_blocks(fake_server) -> None:
    srv = glm_server(fake_server, CALLS, tokens_per_step=3)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = client.messages.create(model="fake-model", max_tokens=400, messages=MESSAGES, tools=tools)
    assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
    assert message.stop_reason == "tool_use" and message.content[0].text == "I'll check."
    assert [(b.name, b.input) for b in message.content[1:]] == EXPECTED
    with client.messages.stream(model="fake-model", max_tokens=400, messages=MESSAGES, tools=tools) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == EXPECTED
    follow_up = [*MESSAGES, {"role": "assistant", "content": message.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
                                              for b in message.content[1:]]}]
    client.messages.create(model="fake-model", max_tokens=400, messages=follow_up, tools=tools)
    assert WEATHER + "\n" + TIME.replace("get_time", "get_time\n").replace("</arg_key>", "</arg_key>\n").replace(
        "</arg_value>", "</arg_value>\n") in last_prompt(srv)


@pytest.mark.parametrize("parser", ["glm45", "hermes"])
def test_tool_parser_flag_picks_the_reader(fake_server, parser: str) -> None:
    srv = glm_server(fake_server, CALLS, tokens_per_step=4, tool_parser=parser)
    message = client_for(srv).chat.completions.create(**request()).choices[0].message
    if parser == "glm45":
        assert calls_of(message) == EXPECTED
    else:  # read as hermes JSON, GLM's calls are not calls: they stay text
        assert message.tool_calls is None and "<arg_key>city</arg_key>" in message.content
