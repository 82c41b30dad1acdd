"""Tool calling end to end through the openai SDK, over a FakeEngine that emits a scripted
model output through a tokenizer with a tool-capable chat template (tests/helpers/tool_models.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import xgrammar
from openai.lib.streaming.chat import ChatCompletionStreamState

from engine.speculation.grammar import GrammarCache
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.sse_helpers import post_stream
from tests.helpers.tool_models import (
    HERMES_TEMPLATE,
    LLAMA_TEMPLATE,
    MISTRAL_TEMPLATE,
    TOOLS,
    last_prompt,
    scripted_engine,
    tool_tokenizer,
)
from tests.helpers.tool_models import (
    openai_client as client_for,
)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
HERMES_CALLS = f"I'll check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call><|end|>"


def hermes_server(fake_server: Callable, script: str, **server_fields: Any) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script), **server_fields)


def calls_of(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, list[Any]]:
    """The SDK's accumulation of a stream (ChatCompletionStreamState) and the raw chunks."""
    state = ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def test_calls_whole_and_streamed_through_the_sdk(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    full = client.chat.completions.create(**request)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC"})]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    prompt = last_prompt(srv)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and prompt.endswith("<|assistant|>\n")

    final, chunks = streamed(client, **request)
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "I'll check."
    assert calls_of(message) == calls_of(choice.message)
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.content and d.tool_calls for d in deltas)  # content and calls never share a chunk
    entries = [t for d in deltas for t in d.tool_calls or []]
    starts = [t for t in entries if t.id is not None]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in starts] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    assert all(t.function.name is None and t.type is None for t in entries if t.id is None)
    assert sum(1 for t in entries if t.index == 0 and t.id is None) > 1  # arguments arrive in fragments
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_tool_choice_none_ignores_tools(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    full = client_for(srv).chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                                   tool_choice="none", temperature=0, max_tokens=400)
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == HERMES_CALLS.removesuffix("<|end|>")
    assert "<tools>" not in last_prompt(srv)


def grammar_of(srv: Any) -> Any:
    """The structured output of the engine's last request, compiled for the server's tokenizer."""
    spec = srv.engine.requests[-1].params.structured_output
    assert spec is not None and spec.kind == "structural_tag"
    tokenizer = srv.engine.tokenizer
    return spec, GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(spec)


def accepts(compiled: Any, text: str, eos: int = 0) -> bool:
    """Whether `text` and then EOS (the tiny tokenizer's <|end|>, id 0) complete the grammar."""
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(eos) and matcher.is_terminated()


def test_tool_choice_required_is_generated_under_the_calls_grammar(fake_server) -> None:
    call = f"<tool_call>\n{TIME}\n</tool_call>"
    srv = hermes_server(fake_server, call + "<|end|>")
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
               "temperature": 0, "max_tokens": 400}
    full = client.chat.completions.create(**request)
    assert last_prompt(srv).endswith("<|assistant|>\n")  # nothing prefilled: the grammar writes the call
    assert full.choices[0].finish_reason == "tool_calls" and full.choices[0].message.content is None
    assert calls_of(full.choices[0].message) == [("get_time", {"tz": "UTC"})]
    _, compiled = grammar_of(srv)
    assert accepts(compiled, call) and accepts(compiled, f"<tool_call>\n{WEATHER}\n</tool_call>\n{call}")
    assert not accepts(compiled, "It is noon.")  # required: calls only
    assert not accepts(compiled, '<tool_call>\n{"name": "get_time", "arguments": {"tz": 3}}\n</tool_call>')
    assert not accepts(compiled, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert not accepts(compiled, '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>')
    final, _ = streamed(client, **request)
    assert calls_of(final.choices[0].message) == [("get_time", {"tz": "UTC"})]


def test_named_tool_choice_allows_one_call_of_that_function(fake_server) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    srv = hermes_server(fake_server, call + "<|end|>")
    client = client_for(srv)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 400}
    full = client.chat.completions.create(**request)
    assert calls_of(full.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    spec, compiled = grammar_of(srv)
    assert "get_time" not in spec.spec
    assert accepts(compiled, call) and not accepts(compiled, call + "\n" + call)
    assert not accepts(compiled, f"<tool_call>\n{TIME}\n</tool_call>")
    final, _ = streamed(client, **request)
    assert calls_of(final.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**request, "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert info.value.body["param"] == "tool_choice"


def test_auto_lets_text_through_and_puts_calls_under_the_grammar(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    client_for(srv).chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=400)
    _, compiled = grammar_of(srv)
    assert accepts(compiled, HERMES_CALLS.removesuffix("<|end|>")) and accepts(compiled, "It is sunny.")
    assert not accepts(compiled, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}')
    client_for(srv).chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=400,
                                            parallel_tool_calls=False)
    _, compiled = grammar_of(srv)
    one = f"<tool_call>\n{TIME}\n</tool_call>"
    assert accepts(compiled, "Sure. " + one) and not accepts(compiled, one + "\n" + one)


def test_auto_with_a_response_format_is_that_format_or_calls(fake_server) -> None:
    srv = hermes_server(fake_server, '{"answer": "sunny"}<|end|>')
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    full = client_for(srv).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert full.choices[0].message.content == '{"answer": "sunny"}'
    _, compiled = grammar_of(srv)
    assert accepts(compiled, '{"answer": "sunny"}') and accepts(compiled, f"<tool_call>\n{TIME}\n</tool_call>")
    assert not accepts(compiled, "It is sunny.") and not accepts(compiled, '{"answer": 1}')


def test_parallel_tool_calls_false(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False,
               "temperature": 0, "max_tokens": 400}
    assert calls_of(client.chat.completions.create(**request).choices[0].message) == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    final, chunks = streamed(client, **request)
    assert calls_of(final.choices[0].message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert {t.index for c in chunks for t in c.choices[0].delta.tool_calls or []} == {0}


def test_malformed_call_is_plain_content(fake_server) -> None:
    script = '<tool_call>\nget_weather(city="Paris")\n</tool_call><|end|>'
    srv = hermes_server(fake_server, script)
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.message.content == script.removesuffix("<|end|>") and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    final, _ = streamed(client, **request)
    assert final.choices[0].message.content == script.removesuffix("<|end|>")
    assert not final.choices[0].message.tool_calls and final.choices[0].finish_reason == "stop"


def test_call_broken_inside_its_arguments(fake_server) -> None:
    """Whole: content. Streamed: the call was sent once its arguments began, so it keeps the
    arguments up to the first bad character and the rest is content; no character is lost."""
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call><|end|>'
    srv = hermes_server(fake_server, script)
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.message.content == script.removesuffix("<|end|>") and choice.message.tool_calls is None
    final, _ = streamed(client, **request)
    message = final.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0].function.arguments == '{"city": '
    assert message.content == "Paris}}\n</tool_call>"


def test_cut_off_call_finishes_with_length(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 12}
    full = client_for(srv).chat.completions.create(**request)
    assert full.choices[0].finish_reason == "length" and full.choices[0].message.tool_calls is None


def test_past_calls_and_results_are_rendered(fake_server) -> None:
    srv = hermes_server(fake_server, "It is 21 degrees in Paris.<|end|>")
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 C, sunny"},
    ]
    full = client_for(srv).chat.completions.create(model="fake-model", messages=messages, tools=TOOLS,
                                                   temperature=0, max_tokens=400)
    assert full.choices[0].message.content == "It is 21 degrees in Paris." and full.choices[0].finish_reason == "stop"
    prompt = last_prompt(srv)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt


def test_a_template_without_tools_serves_plain_text(fake_server) -> None:
    srv = fake_server(FakeEngine(script="Hello there.<|end|>", tokens_per_step=2))
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    for extra in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        full = client.chat.completions.create(**request, **extra)
        assert full.choices[0].message.content == "Hello there." and full.choices[0].message.tool_calls is None
        assert "get_weather" not in last_prompt(srv)
    final, _ = streamed(client, **request)
    assert final.choices[0].message.content == "Hello there." and final.choices[0].finish_reason == "stop"
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        response = httpx.post(srv.url + "/v1/chat/completions", json={**request, "tool_choice": choice,
                                                                        "stream": True}, timeout=30)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "tool_choice"
        assert "cannot call tools" in error["message"] and "does not render tools" in error["message"]


def test_tool_parser_none_turns_tool_calls_off(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS, tool_parser="none")
    client = client_for(srv)
    full = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=400)
    assert full.choices[0].message.content == HERMES_CALLS.removesuffix("<|end|>")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=400)
    assert info.value.body["param"] == "tool_choice" and "--tool-parser none" in info.value.body["message"]


def test_mistral_special_marker_tokens_and_short_ids(fake_server) -> None:
    tokenizer = tool_tokenizer(MISTRAL_TEMPLATE, special=("[TOOL_CALLS]", "[ARGS]"))
    script = f"[TOOL_CALLS][{WEATHER}, {TIME}]<|end|>"
    srv = fake_server(scripted_engine(tokenizer, script, tokens_per_step=2))
    assert srv.state.prompt.tools.format.name == "mistral"
    marker_id = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker_id in srv.engine.script_ids  # the marker is one special token, which decoding would skip
    client = client_for(srv)
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "noon"},
        {"role": "user", "content": "And the weather?"}]
    request = {"model": "fake-model", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    full = client.chat.completions.create(**request)
    expected = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC"})]
    assert calls_of(full.choices[0].message) == expected and full.choices[0].message.content is None
    final, _ = streamed(client, **request)
    assert calls_of(final.choices[0].message) == expected
    prompt = last_prompt(srv)
    assert "[AVAILABLE_TOOLS]" in prompt
    short = [part.split('"')[0] for part in prompt.split('"id": "')[1:] + prompt.split('"call_id": "')[1:]]
    assert len(short) == 2 and short[0] == short[1] and len(short[0]) == 9


def test_llama_python_tag_call(fake_server) -> None:
    tokenizer = tool_tokenizer(LLAMA_TEMPLATE, special=("<|python_tag|>",))
    script = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|end|>'
    srv = fake_server(scripted_engine(tokenizer, script, tokens_per_step=3))
    assert srv.state.prompt.tools.format.name == "llama3_json"
    client = client_for(srv)
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    full = client.chat.completions.create(**request)
    assert calls_of(full.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert calls_of(streamed(client, **request)[0].choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert '"parameters"' in last_prompt(srv)


def test_raw_stream_wire_format(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    body = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 400, "stream": True,
            "stream_options": {"include_usage": True}}
    stream = post_stream(srv.url + "/v1/chat/completions", body)
    chunks = stream.chunks()
    assert stream.data[-1] == "[DONE]" and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"]
    first_call = next(c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"])
    entry = first_call["choices"][0]["delta"]["tool_calls"][0]
    assert set(entry) == {"index", "id", "type", "function"} and entry["function"]["arguments"] == ""
    assert first_call["choices"][0]["delta"] == {"tool_calls": [entry]}
    assert chunks[-2]["choices"][0] | {"logprobs": None} == {"index": 0, "delta": {}, "logprobs": None,
                                                            "finish_reason": "tool_calls"}


def test_each_choice_reads_its_own_calls(fake_server) -> None:
    srv = hermes_server(fake_server, HERMES_CALLS)
    full = client_for(srv).chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                                   temperature=0, max_tokens=400, n=2)
    assert [c.finish_reason for c in full.choices] == ["tool_calls", "tool_calls"]
    ids = [call.id for c in full.choices for call in c.message.tool_calls]
    assert len(ids) == 4 and len(set(ids)) == 4
    final, _ = streamed(client_for(srv), model="fake-model", messages=MESSAGES, tools=TOOLS, temperature=0,
                        max_tokens=400, n=2)
    assert [calls_of(c.message) for c in final.choices] == [calls_of(c.message) for c in full.choices]
    assert [c.finish_reason for c in final.choices] == ["tool_calls", "tool_calls"]


def test_a_second_call_cut_at_its_marker_leaks_no_markup(fake_server) -> None:
    """tool_choice "required": one call, then max_tokens cuts the output right after the next call's "<".
    The reply is the call (finish_reason "length"), whole and streamed; no "<" in any content."""
    first = f"<tool_call>\n{WEATHER}\n</tool_call>\n"
    srv = hermes_server(fake_server, f"{first}<tool_call>\n{TIME}\n</tool_call><|end|>")
    max_tokens = len(srv.engine.tokenizer.encode(first + "<", add_special_tokens=False))
    request = {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
               "temperature": 0, "max_tokens": max_tokens}
    client = client_for(srv)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert calls_of(whole.message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    chunks = post_stream(srv.url + "/v1/chat/completions", {**request, "stream": True}).chunks()
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert not [delta["content"] for delta in deltas if delta.get("content")]
    arguments = "".join(call["function"]["arguments"] for d in deltas for call in d.get("tool_calls") or [])
    assert json.loads(arguments) == {"city": "Paris", "unit": "c"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
