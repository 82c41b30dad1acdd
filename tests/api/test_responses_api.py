"""/v1/responses through openai-python (`responses.create`, `responses.stream`, function tools, stored
responses), over a FakeEngine that emits a scripted output through a tool-capable chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, last_prompt, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as client_for

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'
FUNCTION_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def server(fake_server: Callable, script: str) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script, tokens_per_step=3))


def set_script(srv: Any, script: str) -> None:
    srv.engine.script_ids = srv.engine.tokenizer.encode(script, add_special_tokens=False)


def test_create_returns_output_text_and_usage(fake_server) -> None:
    srv = server(fake_server, "It is sunny in Paris.<|end|>")
    client = client_for(srv)
    response = client.responses.create(model="fake-model", input="Weather in Paris?", instructions="Be brief.",
                                       temperature=0, max_output_tokens=100)
    assert response.output_text == "It is sunny in Paris." and response.status == "completed"
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "fake-model"
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage.input_tokens == len(srv.engine.requests[-1].prompt_ids)
    assert response.usage.output_tokens > 0 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens)
    prompt = last_prompt(srv)
    assert prompt.index("<|system|>\nBe brief.") < prompt.index("<|user|>\nWeather in Paris?")
    assert srv.engine.requests[-1].params.max_tokens == 100


def test_stream_yields_text_deltas_and_a_completed_event(fake_server) -> None:
    srv = server(fake_server, "It is sunny in Paris.<|end|>")
    with client_for(srv).responses.stream(model="fake-model", input="Weather?", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "It is sunny in Paris."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "It is sunny in Paris." and final.status == "completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert kinds.count(kind) == 1, kind


def test_function_tool_round_trip(fake_server) -> None:
    srv = server(fake_server, CALL)
    client = client_for(srv)
    first = client.responses.create(model="fake-model", input="Weather in Paris?", tools=FUNCTION_TOOLS,
                                    tool_choice="required", temperature=0, max_output_tokens=200)
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed" and first.output_text == ""
    assert srv.engine.requests[-1].params.structured_output.kind == "structural_tag"
    set_script(srv, "It is 21 C and sunny.<|end|>")
    follow_up = [{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, sunny"}]
    second = client.responses.create(model="fake-model", input=follow_up, tools=FUNCTION_TOOLS, temperature=0)
    assert second.output_text == "It is 21 C and sunny."
    prompt = last_prompt(srv)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt
    # the same turn through previous_response_id: only the new item is sent
    third = client.responses.create(model="fake-model", previous_response_id=first.id, tools=FUNCTION_TOOLS,
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "21 C, sunny"}])
    assert third.output_text == "It is 21 C and sunny." and last_prompt(srv) == prompt
    assert third.previous_response_id == first.id


def test_streamed_function_call(fake_server) -> None:
    srv = server(fake_server, CALL)
    with client_for(srv).responses.stream(model="fake-model", input="Weather?", tools=FUNCTION_TOOLS,
                                          temperature=0, max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = next(item for item in final.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments and "response.output_text.delta" not in kinds


def test_text_format_json_schema_and_max_output_tokens(fake_server) -> None:
    srv = server(fake_server, '{"city": "Paris"}<|end|>')
    client = client_for(srv)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model="fake-model", input="City?", text={"format": {
        "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"city": "Paris"}
    spec = srv.engine.requests[-1].params.structured_output
    assert spec.kind == "json_schema" and json.loads(spec.spec) == schema
    assert response.text.format.type == "json_schema"
    cut = client.responses.create(model="fake-model", input="City?", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"


def test_stored_responses_get_delete_and_input_items(fake_server) -> None:
    srv = server(fake_server, "Hi.<|end|>")
    client = client_for(srv)
    created = client.responses.create(model="fake-model", input="Hello")
    assert client.responses.retrieve(created.id).output_text == "Hi."
    items = client.responses.input_items.list(created.id)
    assert [item.type for item in items.data] == ["message"] and items.data[0].id
    assert client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    unstored = client.responses.create(model="fake-model", input="Hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_bad_requests_name_the_field(fake_server) -> None:
    srv = server(fake_server, "Hi.<|end|>")
    cases = [({"input": "x", "background": True}, 400, "background"),
             ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
              "input[0].content[0]"),
             ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, 400, "input[0].id"),
             ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
             ({}, 400, "input"), ({"input": 5}, 400, "input"),
             ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
             ({"input": "x", "temperature": 3}, 400, "temperature")]
    for body, status, param in cases:
        response = httpx.post(srv.url + "/v1/responses", json={"model": "fake-model", **body}, timeout=30)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.json())


def test_output_items_one_at_a_time_and_no_partial_markup(fake_server) -> None:
    """A call cut by max_output_tokens right after the next call's "<": one function_call item, no message
    item; streamed, every item's events lie between its `output_item.added` and `output_item.done`."""
    first = CALL.removesuffix("<|end|>") + "\n"
    srv = server(fake_server, first + "<tool_call>\n{}\n</tool_call><|end|>")
    max_tokens = len(srv.engine.tokenizer.encode(first + "<", add_special_tokens=False))
    request = {"model": "fake-model", "input": "Weather?", "tools": FUNCTION_TOOLS, "tool_choice": "required",
               "temperature": 0, "max_output_tokens": max_tokens}
    whole = client_for(srv).responses.create(**request)
    assert [item.type for item in whole.output] == ["function_call"] and whole.status == "incomplete"
    body = {**request, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["function_call"]
    assert_items_one_at_a_time(events)


def assert_items_one_at_a_time(events: list[dict[str, Any]]) -> None:
    open_index = None
    for event in events:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert open_index is None, event
            open_index = index
        elif event["type"] == "response.output_item.done":
            assert index == open_index, event
            open_index = None
        elif index is not None:
            assert index == open_index, event
    assert open_index is None


def test_a_call_then_text_are_two_items_one_after_the_other() -> None:
    from server.responses_api.output import OutputItems
    from server.toolcalls.output import Delta

    items = OutputItems()
    events = []
    for delta in [Delta(tool_call={"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}),
                  Delta(tool_call={"index": 0, "function": {"arguments": "{}"}}), Delta(content="Done."),
                  Delta(tool_call={"index": 1, "id": "call_2", "type": "function",
                                   "function": {"name": "g", "arguments": ""}}),
                  Delta(tool_call={"index": 1, "function": {"arguments": "{}"}}),
                  Delta(tool_call={"index": 2, "id": "call_3", "type": "function",
                                   "function": {"name": "h", "arguments": ""}})]:
        events += [{"type": kind, **fields} for kind, fields in items.feed(delta)]
    events += [{"type": kind, **fields} for kind, fields in items.close("completed")]
    assert_items_one_at_a_time(events)
    assert [item["type"] for item in items.items] == ["function_call", "message", "function_call", "function_call"]
    assert all(item["status"] == "completed" for item in items.items)
