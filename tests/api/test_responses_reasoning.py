"""/v1/responses with a reasoning model (server/responses_api/output.py, items.py): a scripted engine
writes `<think>a b</think>answer` through a template with think tags; openai-python's
`client.responses` sees a `reasoning` item (`reasoning_text` content) before the message, whole and
streamed with its own events; `reasoning.effort` reaches the template; reasoning items sent back (with
content, or only `encrypted_content` as Codex sends them) are accepted and rendered as the assistant's
reasoning where the template renders it; stored responses carry it on through previous_response_id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.api.test_reasoning_api import SCRIPT, THINK_TEMPLATE
from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as oai

# THINK_TEMPLATE that also renders a past assistant turn's reasoning_content (as Qwen3's does)
REPLAY_TEMPLATE = THINK_TEMPLATE.replace(
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n",
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}").replace(
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}",
    "{% else %}<|{{ m.role }}|>\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}")


def serve(fake_server: Callable, script: str = SCRIPT, template: str = REPLAY_TEMPLATE) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(template), script))


def prompt(srv: Any) -> str:
    return srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)


def test_reasoning_item_before_the_message(fake_server) -> None:
    response = oai(serve(fake_server)).responses.create(model="fake-model", input="hi")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", "a b")]
    assert response.output_text == "answer"


def test_reasoning_streamed_with_its_events(fake_server) -> None:
    client = oai(serve(fake_server))
    events = list(client.responses.create(model="fake-model", input="hi", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    added = events[2]
    assert (added.output_index, added.item.type, added.item.status) == (0, "reasoning", "in_progress")
    assert events[3].part.type == "reasoning_text"
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in deltas) == "a b"
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(added.item.id, 0, 0)}
    done = kinds.index("response.reasoning_text.done")
    assert events[done].text == "a b" and events[done].item_id == added.item.id
    assert kinds[done + 1:done + 3] == ["response.content_part.done", "response.output_item.done"]
    assert events[done + 2].item.content[0].text == "a b"
    # the message comes after the reasoning item is done, at output_index 1
    message_added = events[done + 3]
    assert message_added.type == "response.output_item.added" and message_added.item.type == "message"
    assert message_added.output_index == 1
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "answer"
    final = events[-1].response
    assert events[-1].type == "response.completed" and [i.type for i in final.output] == ["reasoning", "message"]
    with client.responses.stream(model="fake-model", input="hi") as stream:
        whole = stream.get_final_response()
    assert (whole.output[0].content[0].text, whole.output_text) == ("a b", "answer")


def test_template_without_think_tags_keeps_the_block_in_the_text(fake_server) -> None:
    response = oai(serve(fake_server, template=HERMES_TEMPLATE)).responses.create(model="fake-model", input="hi")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == "<think>a b</think>answer"


@pytest.mark.parametrize("effort,closed", [("none", True), ("minimal", True), ("high", False), (None, False)])
def test_reasoning_effort_reaches_the_template(fake_server, effort: str | None, closed: bool) -> None:
    srv = serve(fake_server, "answer<|end|>")
    reasoning = {"effort": effort, "summary": "auto"} if effort else {"summary": "auto"}
    response = oai(srv).responses.create(model="fake-model", input="hi", reasoning=reasoning)
    # THINK_TEMPLATE closes an empty block in the generation prompt when enable_thinking is false
    assert prompt(srv).endswith("<think>\n\n</think>\n\n") is closed
    assert [item.type for item in response.output] == ["message"] and response.output_text == "answer"
    assert response.reasoning.effort == effort


def test_unknown_reasoning_effort_is_a_400(fake_server) -> None:
    reply = httpx.post(serve(fake_server).url + "/v1/responses", timeout=30,
                       json={"input": "hi", "reasoning": {"effort": "extreme"}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning.effort"


def test_reasoning_items_sent_back_are_rendered(fake_server) -> None:
    srv = serve(fake_server)
    first = oai(srv).responses.create(model="fake-model", input="hi")
    # the whole history sent back as the SDK returned it (reasoning item with content) and a new turn
    history = [{"role": "user", "content": "hi"}] + [item.model_dump(exclude_none=True) for item in first.output]
    oai(srv).responses.create(model="fake-model", input=history + [{"role": "user", "content": "more"}])
    assert "<|assistant|>\n<think>a b</think>answer<|end|>" in prompt(srv)
    # a reasoning item with only encrypted_content (Codex, store false) is accepted and renders nothing
    encrypted = [{"role": "user", "content": "hi"},
                 {"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": "gAAAA=="},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}]},
                 {"role": "user", "content": "more"}]
    oai(srv).responses.create(model="fake-model", input=encrypted, store=False)
    assert "<|assistant|>\nanswer<|end|>" in prompt(srv) and "gAAAA" not in prompt(srv)
    # reasoning before a call joins the call's assistant message; reasoning before a user turn is dropped
    calls = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "lost"}]},
             {"role": "user", "content": "more"}]
    oai(srv).responses.create(model="fake-model", input=calls)
    assert "<|assistant|>\n<think>call it</think><tool_call>" in prompt(srv) and "lost" not in prompt(srv)


def test_stored_reasoning_goes_on_with_previous_response_id(fake_server) -> None:
    srv = serve(fake_server)
    client = oai(srv)
    first = client.responses.create(model="fake-model", input="hi")
    client.responses.create(model="fake-model", input="more", previous_response_id=first.id)
    assert "<|assistant|>\n<think>a b</think>answer<|end|>" in prompt(srv)
    # a reasoning input item is stored with its content (the input_items list returns it)
    replay = [{"type": "reasoning", "id": "rs_in", "summary": [],
               "content": [{"type": "reasoning_text", "text": "kept"}], "encrypted_content": "opaque"},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
              {"role": "user", "content": "next"}]
    second = client.responses.create(model="fake-model", input=replay)
    listed = httpx.get(f"{srv.url}/v1/responses/{second.id}/input_items", timeout=30).json()["data"]
    assert listed[0] == {"id": "rs_in", "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "kept"}]}
    client.responses.create(model="fake-model", input="again", previous_response_id=second.id)
    assert "<think>kept</think>x" in prompt(srv)


def test_a_call_after_reasoning(fake_server) -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    client = oai(serve(fake_server, f"<think>I should call.</think>\n<tool_call>\n{call}\n</tool_call><|end|>"))
    tools = [{"type": "function"} | tool["function"] for tool in TOOLS]
    response = client.responses.create(model="fake-model", input="hi", tools=tools, max_output_tokens=300)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert (response.output[0].content[0].text, response.output[1].name) == ("I should call.", "get_weather")
    events = list(client.responses.create(model="fake-model", input="hi", tools=tools, max_output_tokens=300,
                                          stream=True))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(0, "reasoning"), (1, "function_call")]
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")


def test_chat_messages_carry_reasoning_content_to_the_template(fake_server) -> None:
    srv = serve(fake_server)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer", "reasoning_content": "a b"},
                {"role": "user", "content": "more"}]
    oai(srv).chat.completions.create(model="fake-model", messages=messages)  # type: ignore[arg-type]
    assert "<|assistant|>\n<think>a b</think>answer<|end|>" in prompt(srv)
