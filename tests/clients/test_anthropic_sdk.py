"""The anthropic Python SDK against a running `specexec serve` (tests/clients/conftest.py): create, stream,
a tool round trip under tool_choice "any", count_tokens, and three Claude Code-shaped turns whose prompt
prefix the cache keeps serving although the billing-header block changes every turn."""

from __future__ import annotations

from typing import Any

import anthropic
import jsonschema
import pytest

from tests.clients.conftest import MODEL

WORD = {"type": "string", "pattern": "^[A-Za-z /_]{1,16}$"}  # a random model closes a bounded string
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": WORD, "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"]}}
GREEDY = {"temperature": 0}  # the 2026 SDK has no `temperature` argument: sent as an extra field


@pytest.fixture(scope="module")
def client(clients_server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=clients_server.url, api_key="unused", max_retries=0, timeout=300)


def test_create_and_stream_give_the_same_greedy_text(client: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "max_tokens": 24, "system": "Answer briefly.",
               "messages": [{"role": "user", "content": "Write a loop."}], "extra_body": GREEDY}
    message = client.messages.create(**request)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.model == MODEL
    text = "".join(block.text for block in message.content if block.type == "text")
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)


def test_tool_round_trip(client: anthropic.Anthropic) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [block.input for block in streamed.content if block.type == "tool_use"] == [call.input for call in calls]
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"}
                                              for call in calls]}]
    second = client.messages.create(model=MODEL, max_tokens=16, messages=messages, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens)


def test_count_tokens_is_the_prompt_the_message_runs(client: anthropic.Anthropic) -> None:
    request = {"model": MODEL, "system": "Be brief.", "tools": [WEATHER],
               "messages": [{"role": "user", "content": "Weather in Rome?"}]}
    counted = client.messages.count_tokens(**request)
    message = client.messages.create(max_tokens=4, extra_body=GREEDY, **request)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def claude_code_turn(turn: int, history: list[dict[str, Any]]) -> dict[str, Any]:
    """A request shaped as Claude Code sends it: the billing header (a new `cch` every request), the
    system prompt, a `system` turn in the messages, metadata, thinking, ~beta fields."""
    return {"model": MODEL, "max_tokens": 12, "stream": True, "metadata": {"user_id": '{"session_id": "s1"}'},
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=cli; "
                                                f"cch={turn:05d};"},
                       {"type": "text", "text": "You are a coding agent. Keep answers short and exact.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": history, "thinking": {"type": "adaptive"}, "tools": [WEATHER]}


def test_three_claude_code_turns_read_a_growing_prefix_from_the_cache(client: anthropic.Anthropic) -> None:
    history: list[dict[str, Any]] = []
    reads, prompts = [], []
    for turn, question in enumerate(["List the files.", "Now count them.", "And sort them."]):
        history.append({"role": "user", "content": [{"type": "text", "text": question}]})
        body = claude_code_turn(turn, history)
        with client.messages.stream(extra_query={"beta": "true"}, extra_headers={"anthropic-beta": "claude-code-20250219"},
                                    extra_body={"thinking": body.pop("thinking"), **GREEDY},
                                    **{k: v for k, v in body.items() if k != "stream"}) as stream:
            message = stream.get_final_message()
        reads.append(message.usage.cache_read_input_tokens)
        prompts.append(message.usage.input_tokens + message.usage.cache_read_input_tokens)
        history.append({"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                         for block in message.content] or "..."})
    assert reads[0] < reads[1] < reads[2], (reads, prompts)
    # each turn reads at least the previous turn's whole prompt from the cache
    assert reads[1] >= prompts[0] - 1 and reads[2] >= prompts[1] - 1, (reads, prompts)
