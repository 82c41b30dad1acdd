"""GPT-OSS's harmony output on every API surface, through the real SDKs: a FakeEngine writes a scripted
harmony output (tests/helpers/harmony_models.py: GPT-OSS's own chat template, the harmony special
tokens) and each surface shows the analysis as reasoning, the final channel as content and a
`commentary to=functions.NAME` message as a tool call, whole and streamed, with no channel markup."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import ollama
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.helpers.harmony_models import ANSWER, CALL, harmony_engine
from tests.helpers.tool_models import TOOLS, last_prompt
from tests.helpers.tool_models import openai_client as oai

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
MARKUP = ("<|", "analysis", "assistant", "final")  # none of these reaches a client
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def serve(fake_server: Callable, script: str = ANSWER, **fields: Any) -> Any:
    return fake_server(harmony_engine(script, tokens_per_step=2), **fields)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, str]:
    """The SDK's accumulation of a stream, and the streamed reasoning_content joined."""
    state = ChatCompletionStreamState()
    reasoning = []
    for chunk in client.chat.completions.create(model="fake-model", stream=True, **kwargs):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
    return state.get_final_completion().choices[0], "".join(reasoning)


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_openai_answer_whole_and_streamed(fake_server) -> None:
    client = oai(serve(fake_server))
    choice = client.chat.completions.create(model="fake-model", messages=MESSAGES).choices[0]
    assert (reasoning_of(choice.message), choice.message.content) == ("We need to add 2 and 2.", "The answer is 4.")
    assert choice.finish_reason == "stop"
    final, reasoning = streamed(client, messages=MESSAGES)
    assert (reasoning, final.message.content, final.finish_reason) == \
        ("We need to add 2 and 2.", "The answer is 4.", "stop")


def test_openai_tool_call_whole_and_streamed(fake_server) -> None:
    srv = serve(fake_server, CALL)
    client = oai(srv)
    choice = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                            max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert reasoning_of(choice.message) == "Need weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    prompt = last_prompt(srv)
    assert "namespace functions {" in prompt and "type get_weather = (_: {" in prompt
    assert prompt.endswith("<|start|>assistant")
    final, reasoning = streamed(client, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    assert (final.finish_reason, reasoning) == ("tool_calls", "Need weather.") and not final.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


def test_reasoning_format_none_puts_the_analysis_in_the_content(fake_server) -> None:
    client = oai(serve(fake_server, reasoning_format="none"))
    message = client.chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message
    assert message.content == "We need to add 2 and 2.\n\nThe answer is 4." and reasoning_of(message) is None


def test_cut_off_keeps_what_was_read_in_its_channel(fake_server) -> None:
    client = oai(serve(fake_server))
    cut = len(harmony_engine(ANSWER).script_ids) - 5  # ends inside the final message
    choice = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=cut).choices[0]
    assert choice.finish_reason == "length" and reasoning_of(choice.message) == "We need to add 2 and 2."
    assert choice.message.content and "The answer is 4.".startswith(choice.message.content)
    assert not any(mark in choice.message.content for mark in MARKUP)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_writes_the_call_under_its_grammar(fake_server, choice: Any) -> None:
    """The call's grammar (server/harmony_output.py forced_call; its walk: tests/api/test_harmony_structured.py)
    goes to the engine, and the call comes back as a tool call (it was a 400)."""
    srv = serve(fake_server, CALL)
    message = oai(srv).chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               max_tokens=300).choices[0].message
    assert message.tool_calls[0].function.name == "get_weather"
    grammar = srv.engine.requests[-1].params.structured_output
    assert grammar is not None and grammar.reasoning is not None and "functions.get_weather" in grammar.spec
    assert ("functions.get_time" in grammar.spec) == (choice == "required")


def test_reasoning_effort_reaches_the_template(fake_server) -> None:
    srv = serve(fake_server)
    client = oai(srv)
    client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert "Reasoning: medium" in last_prompt(srv)
    client.chat.completions.create(model="fake-model", messages=MESSAGES, reasoning_effort="high")
    assert "Reasoning: high" in last_prompt(srv)
    client.chat.completions.create(model="fake-model", messages=MESSAGES, reasoning_effort="high",
                                   extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert "Reasoning: low" in last_prompt(srv)


def test_tool_choice_none_renders_no_tools(fake_server) -> None:
    srv = serve(fake_server)
    message = oai(srv).chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                               tool_choice="none").choices[0].message
    assert message.content == "The answer is 4." and "namespace functions" not in last_prompt(srv)


def test_past_turns_reach_the_template_with_thinking(fake_server) -> None:
    srv = serve(fake_server)
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning_content": "Need weather.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    oai(srv).chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)
    assert last_prompt(srv).endswith(
        '<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>'
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        '<|start|>assistant')


def anthropic_client(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def test_anthropic_thinking_text_and_tool_use(fake_server) -> None:
    srv = serve(fake_server)
    client = anthropic_client(srv)
    kwargs: dict[str, Any] = {"model": "fake-model", "max_tokens": 200, "messages": MESSAGES}
    message = client.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
        [("thinking", "We need to add 2 and 2."), ("text", "The answer is 4.")]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "The answer is 4."
    srv.engine.script_ids = srv.engine.tokenizer.encode(CALL, add_special_tokens=False)
    kwargs["tools"] = ANTHROPIC_TOOLS
    for reply in (client.messages.create(**kwargs), _final_message(client, kwargs)):
        assert reply.stop_reason == "tool_use"
        assert [b.type for b in reply.content] == ["thinking", "tool_use"]
        assert (reply.content[1].name, reply.content[1].input) == ("get_weather", {"city": "Paris"})


def _final_message(client: anthropic.Anthropic, kwargs: dict[str, Any]) -> Any:
    with client.messages.stream(**kwargs) as stream:
        return stream.get_final_message()


def test_anthropic_past_thinking_block_reaches_the_template(fake_server) -> None:
    srv = serve(fake_server)
    messages = MESSAGES + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need weather.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    anthropic_client(srv).messages.create(model="fake-model", max_tokens=50, messages=messages, tools=ANTHROPIC_TOOLS)
    assert "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather" \
        in last_prompt(srv)


def test_ollama_thinking_content_and_tool_calls(fake_server) -> None:
    srv = serve(fake_server)
    client = ollama.Client(host=srv.url, timeout=60)
    reply = client.chat(model="fake-model", messages=MESSAGES, stream=False)
    assert (reply.message.thinking, reply.message.content) == ("We need to add 2 and 2.", "The answer is 4.")
    parts = list(client.chat(model="fake-model", messages=MESSAGES, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "We need to add 2 and 2."
    assert "".join(p.message.content or "" for p in parts) == "The answer is 4."
    srv.engine.script_ids = srv.engine.tokenizer.encode(CALL, add_special_tokens=False)
    reply = client.chat(model="fake-model", messages=MESSAGES, tools=TOOLS, stream=False, options={"num_predict": 200})
    assert [(c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    parts = list(client.chat(model="fake-model", messages=MESSAGES, tools=TOOLS, stream=True,
                             options={"num_predict": 200}))
    assert [c.function.name for p in parts for c in p.message.tool_calls or []] == ["get_weather"]
    past = [*MESSAGES, {"role": "assistant", "content": "4.", "thinking": "Easy."}, {"role": "user", "content": "ok"}]
    client.chat(model="fake-model", messages=past, stream=False)
    assert "<|start|>assistant<|channel|>final<|message|>4.<|end|>" in last_prompt(srv)  # past CoT dropped


def test_responses_reasoning_output_text_and_function_call(fake_server) -> None:
    srv = serve(fake_server)
    client = oai(srv)
    response = client.responses.create(model="fake-model", input="What is 2 + 2?")
    assert response.output_text == "The answer is 4."
    reasoning = [item for item in response.output if item.type == "reasoning"]  # the analysis, its own item
    assert [part.text for item in reasoning for part in item.content] == ["We need to add 2 and 2."]
    assert response.output.index(reasoning[0]) == 0
    srv.engine.script_ids = srv.engine.tokenizer.encode(CALL, add_special_tokens=False)
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    for response in (client.responses.create(model="fake-model", input="Weather?", tools=tools, max_output_tokens=200),
                     _final_response(client, tools)):
        calls = [item for item in response.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
        assert not response.output_text


def _final_response(client: openai.OpenAI, tools: list[dict[str, Any]]) -> Any:
    with client.responses.stream(model="fake-model", input="Weather?", tools=tools, max_output_tokens=200) as stream:
        list(stream)
        return stream.get_final_response()


def test_forced_tool_choice_with_tool_parser_none_is_a_400(fake_server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai(serve(fake_server, CALL, tool_parser="none")).chat.completions.create(
            model="fake-model", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert info.value.body["param"] == "tool_choice" and "--tool-parser none" in info.value.body["message"]
