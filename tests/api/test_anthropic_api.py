"""/v1/messages and /v1/messages/count_tokens through the anthropic SDK and raw HTTP, over a FakeEngine that
emits a scripted output through a tool-capable chat template: shapes, events, stop reasons, the prompt the
request becomes (Claude Code's billing header dropped), errors in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest

from tests.helpers.tool_models import HERMES_TEMPLATE, last_prompt, scripted_engine, tool_tokenizer

CALL = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def server(fake_server: Callable, script: str, **fields: Any) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script, tokens_per_step=3), **fields)


def client_for(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def test_create_returns_text_usage_and_end_turn(fake_server) -> None:
    srv = server(fake_server, "It is sunny.<|end|>")
    message = client_for(srv).messages.create(model="fake-model", max_tokens=50, messages=USER, system="Be brief.",
                                              extra_body={"temperature": 0})
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == "It is sunny."
    assert message.stop_reason == "end_turn" and message.stop_sequence is None and message.model == "fake-model"
    request = srv.engine.requests[-1]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(request.prompt_ids)
    assert message.usage.output_tokens > 0 and request.params.max_tokens == 50 and request.params.temperature == 0
    assert last_prompt(srv).index("<|system|>\nBe brief.") < last_prompt(srv).index("<|user|>\nWeather in Paris?")


def test_stream_has_anthropics_event_sequence(fake_server) -> None:
    srv = server(fake_server, "It is sunny.<|end|>")
    response = httpx.post(srv.url + "/v1/messages?beta=true", timeout=30, headers={
        "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"},
        json={"model": "fake-model", "max_tokens": 50, "messages": USER, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [(block.split("\n")[0].removeprefix("event: "), json.loads(block.split("\n")[1].removeprefix("data: ")))
              for block in response.text.strip().split("\n\n") if block.startswith("event:")]
    kinds = [kind for kind, _ in events if kind != "ping"]
    assert all(kind == data["type"] for kind, data in events)
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and ("ping", {"type": "ping"}) in events
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    text = "".join(data["delta"]["text"] for kind, data in events if kind == "content_block_delta")
    assert text == "It is sunny."
    delta = next(data for kind, data in events if kind == "message_delta")
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0 and delta["usage"]["input_tokens"] > 0


def test_tool_use_round_trip_streamed_and_not(fake_server) -> None:
    srv = server(fake_server, CALL)
    client = client_for(srv)
    message = client.messages.create(model="fake-model", max_tokens=200, messages=USER, tools=TOOLS)
    assert [block.type for block in message.content] == ["text", "tool_use"] and message.stop_reason == "tool_use"
    call = message.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    with client.messages.stream(model="fake-model", max_tokens=200, messages=USER, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris"}
    deltas = [event.delta.partial_json for event in events if event.type == "content_block_delta"
              and event.delta.type == "input_json_delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris"}
    srv.engine.script_ids = srv.engine.tokenizer.encode("It is 21 C.<|end|>", add_special_tokens=False)
    follow_up = USER + [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in
                                                          message.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                      "content": [{"type": "text", "text": "21 C, sunny"}]},
                                                     {"type": "text", "text": "And tomorrow?"}]}]
    second = client.messages.create(model="fake-model", max_tokens=50, messages=follow_up, tools=TOOLS)
    assert second.content[0].text == "It is 21 C." and second.stop_reason == "end_turn"
    prompt = last_prompt(srv)
    assert 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.index("<tool_response>\n21 C, sunny\n</tool_response>") < prompt.index("<|user|>\nAnd tomorrow?")


@pytest.mark.parametrize(("choice", "kind", "single"), [
    ({"type": "any"}, "structural_tag", False), ({"type": "tool", "name": "get_time"}, "structural_tag", True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "structural_tag", True), ({"type": "none"}, None, False)])
def test_tool_choice_maps_to_chats(fake_server, choice: dict, kind: str | None, single: bool) -> None:
    srv = server(fake_server, CALL)
    client_for(srv).messages.create(model="fake-model", max_tokens=200, messages=USER, tools=TOOLS, tool_choice=choice)
    spec = srv.engine.requests[-1].params.structured_output
    assert (spec.kind if spec else None) == kind
    if choice["type"] == "tool":
        assert "get_weather" not in spec.spec and "get_time" in spec.spec
    if spec is not None:
        assert json.loads(spec.spec)["format"].get("stop_after_first", False) == single or choice["type"] == "tool"
    assert ("get_weather" in last_prompt(srv)) == (choice["type"] != "none")


def test_stop_sequences_and_max_tokens_stop_reasons(fake_server) -> None:
    srv = server(fake_server, "It is sunny. Really.<|end|>")
    client = client_for(srv)
    stopped = client.messages.create(model="fake-model", max_tokens=50, messages=USER, stop_sequences=["sunny"])
    assert stopped.content[0].text == "It is " and stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "sunny"
    cut = client.messages.create(model="fake-model", max_tokens=2, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_claude_code_billing_header_and_system_turns_are_normalised(fake_server) -> None:
    srv = server(fake_server, "Hello.<|end|>")
    client = client_for(srv)
    prompts = []
    for cch in ("a5145", "0bc9e"):
        client.messages.create(model="fake-model", max_tokens=20, metadata={"user_id": "u"}, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
                      {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}],
            thinking={"type": "adaptive"}, extra_body={"context_management": {"edits": []},
                                                        "output_config": {"effort": "high"}})
        prompts.append(last_prompt(srv))
    assert prompts[0] == prompts[1] and "billing" not in prompts[0] and "cch" not in prompts[0]
    assert "<|system|>\nYou are Claude Code.<|end|>\n<|user|>\nSay hello\n# Environment<|end|>" in prompts[0]


def test_server_and_deferred_tools_are_left_out(fake_server) -> None:
    srv = server(fake_server, "Hello.<|end|>")
    tools = TOOLS[:1] + [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                         {"type": "bash_20250124", "name": "bash"},
                         {"name": "Deferred", "input_schema": {"type": "object"}, "defer_loading": True}]
    client_for(srv).messages.create(model="fake-model", max_tokens=20, messages=USER, tools=tools)
    prompt = last_prompt(srv)
    assert "get_weather" in prompt and "web_search" not in prompt and "bash" not in prompt and "Deferred" not in prompt


def test_count_tokens_matches_the_prompt_of_the_request(fake_server) -> None:
    srv = server(fake_server, "Hello.<|end|>")
    client = client_for(srv)
    counted = client.messages.count_tokens(model="fake-model", messages=USER, tools=TOOLS, system="Be brief.")
    message = client.messages.create(model="fake-model", max_tokens=20, messages=USER, tools=TOOLS, system="Be brief.")
    assert counted.input_tokens == len(srv.engine.requests[-1].prompt_ids) == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)
    plain = client.messages.count_tokens(model="fake-model", messages=USER)
    assert plain.input_tokens < counted.input_tokens


def anthropic_error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    return body["error"]


@pytest.mark.parametrize(("body", "status", "error_type", "words"), [
    ({"model": "nope"}, 404, "not_found_error", "nope"),
    ({"max_tokens": "5"}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "image"),
    ({"messages": USER + [{"role": "assistant", "content": "Prefill"}]}, 400, "invalid_request_error", "prefill"),
    ({"tools": [{"name": "f"}]}, 400, "invalid_request_error", "input_schema"),
    ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool_choice.name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400, "invalid_request_error", "nope"),
    ({"stop_sequences": [""]}, 400, "invalid_request_error", "Stop"),
    ({"system": [{"type": "image"}]}, 400, "invalid_request_error", "System"),
])
def test_bad_requests_get_anthropic_shaped_errors(fake_server, body: dict, status: int, error_type: str,
                                                  words: str) -> None:
    srv = server(fake_server, "Hello.<|end|>")
    full = {"model": "fake-model", "max_tokens": 20, "messages": USER} | body
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and ("max_tokens" in body or "stop_sequences" in body or "temperature" in body):
            continue  # fields count_tokens does not use
        response = httpx.post(srv.url + path, json=full, timeout=30)
        assert response.status_code == status, (path, body, response.text)
        error = anthropic_error(response)
        assert error["type"] == error_type and words in error["message"], (path, body, error)


def test_transport_errors_and_the_api_key_have_anthropics_shape(fake_server) -> None:
    srv = server(fake_server, "Hello.<|end|>", api_key="secret")
    url = srv.url + "/v1/messages"
    body = {"max_tokens": 5, "messages": USER}
    missing = httpx.post(url, json=body, timeout=30)
    assert missing.status_code == 401 and anthropic_error(missing)["type"] == "authentication_error"
    for headers in ({"x-api-key": "secret"}, {"authorization": "Bearer secret"}):
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
    keyed = {"x-api-key": "secret"}
    not_json = httpx.post(url, content=b"{}", headers=keyed | {"content-type": "text/plain"}, timeout=30)
    assert not_json.status_code == 415 and anthropic_error(not_json)["type"] == "invalid_request_error"
    broken = httpx.post(url, content=b"{", headers=keyed | {"content-type": "application/json"}, timeout=30)
    assert broken.status_code == 400 and "JSON" in anthropic_error(broken)["message"]
    with pytest.raises(anthropic.AuthenticationError):
        client_for(srv).messages.create(model="fake-model", max_tokens=5, messages=USER)
    keyed_client = anthropic.Anthropic(base_url=srv.url, api_key="secret", max_retries=0, timeout=60)
    assert keyed_client.messages.create(model="fake-model", max_tokens=5, messages=USER).content


def test_a_failing_generation_is_an_error_event_and_the_server_goes_on(fake_server) -> None:
    srv = server(fake_server, "Hello.<|end|>")
    srv.engine.fail_with = RuntimeError("boom")
    response = httpx.post(srv.url + "/v1/messages", json={"max_tokens": 20, "messages": USER, "stream": True},
                          timeout=30)
    assert response.status_code == 200 and "event: error" in response.text and "message_stop" not in response.text
    whole = httpx.post(srv.url + "/v1/messages", json={"max_tokens": 20, "messages": USER}, timeout=30)
    assert whole.status_code == 500 and anthropic_error(whole)["type"] == "api_error"
    srv.engine.fail_with = None
    assert client_for(srv).messages.create(model="fake-model", max_tokens=20, messages=USER).content[0].text == "Hello."
