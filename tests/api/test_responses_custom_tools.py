"""Custom (freeform) tools on /v1/responses through openai-python, as Codex's `apply_patch` is one
(`{"type": "custom", "format": {"type": "grammar", "syntax": "lark", ...}}`): offered to the model as a
function taking one string, `input`; its call comes back as a `custom_tool_call` item whose `input` is
that string, whole and streamed (`response.custom_tool_call_input.delta` / `.done`); `custom_tool_call`
and `custom_tool_call_output` input items are a tool call and a tool result in the chat template."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import httpx

from server.responses_api.custom_tools import InputReader
from tests.api.test_responses_api import FUNCTION_TOOLS, assert_items_one_at_a_time
from tests.helpers.tool_models import HERMES_TEMPLATE, last_prompt, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as client_for

PATCH = '*** Begin Patch\n*** Add File: hello.py\n+print("héllo")\n+\tx = 1\n*** End Patch\n'
GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Use `apply_patch` to edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
CUSTOM_CALL = ('<tool_call>\n{"name": "apply_patch", "arguments": ' + json.dumps({"input": PATCH}, ensure_ascii=False)
               + '}\n</tool_call>')
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def server(fake_server: Callable, script: str) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script, tokens_per_step=3))


def test_a_custom_tool_call_whole_forced_and_its_round_trip(fake_server) -> None:
    srv = server(fake_server, CUSTOM_CALL + "<|end|>")
    client = client_for(srv)
    tools = [*FUNCTION_TOOLS, APPLY_PATCH]
    first = client.responses.create(model="fake-model", input="Add hello.py", tools=tools, temperature=0,
                                    tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=300)
    assert first.status == "completed" and [item.type for item in first.output] == ["custom_tool_call"]
    call = first.output[0]
    assert call.name == "apply_patch" and call.input == PATCH and call.call_id.startswith("call_")
    assert call.id.startswith("ctc_") and first.output_text == "" and first.tool_choice.type == "custom"
    prompt = last_prompt(srv)
    assert '"name": "apply_patch", "description": "Use `apply_patch` to edit files."' in prompt
    assert '"properties": {"input": {"type": "string"' in prompt and json.dumps(GRAMMAR)[1:-1] in prompt
    spec = srv.engine.requests[-1].params.structured_output  # forced as chat's named function is
    assert spec.kind == "structural_tag" and "apply_patch" in spec.spec and "get_weather" not in spec.spec
    # the next turn, as Codex sends it: the call and its output as input items
    srv.engine.script_ids = srv.engine.tokenizer.encode("Added.<|end|>", add_special_tokens=False)
    output = {"type": "custom_tool_call_output", "call_id": call.call_id,
              "output": [{"type": "input_text", "text": "Success. Updated: A hello.py"}]}
    second = client.responses.create(model="fake-model", tools=tools, temperature=0, input=[
        {"role": "user", "content": "Add hello.py"}, call.model_dump(exclude_none=True), output])
    assert second.output_text == "Added."
    prompt = last_prompt(srv)
    assert CUSTOM_CALL in prompt and "<tool_response>\nSuccess. Updated: A hello.py\n</tool_response>" in prompt
    # the same turn through previous_response_id: the stored custom_tool_call is in the conversation
    third = client.responses.create(model="fake-model", tools=tools, temperature=0, previous_response_id=first.id,
                                    input=[output])
    assert third.output_text == "Added." and last_prompt(srv) == prompt
    items = client.responses.input_items.list(third.id).data
    assert [item.type for item in items] == ["custom_tool_call_output"] and items[0].id.startswith("ctco_")


def test_streamed_custom_tool_call_input_deltas_beside_a_function_call(fake_server) -> None:
    srv = server(fake_server, WEATHER_CALL + "\n" + CUSTOM_CALL + "<|end|>")
    with client_for(srv).responses.stream(model="fake-model", input="Weather, then add hello.py", temperature=0,
                                          tools=[*FUNCTION_TOOLS, {**APPLY_PATCH, "format": {"type": "text"}}],
                                          max_output_tokens=400) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["function_call", "custom_tool_call"]
    weather, patch = final.output
    assert json.loads(weather.arguments) == {"city": "Paris"} and patch.input == PATCH and patch.name == "apply_patch"
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert len(deltas) > 5 and "".join(deltas) == PATCH  # the string itself, escapes decoded, in pieces
    kinds = [e.type for e in events if getattr(e, "output_index", None) == 1]
    assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
        "response.custom_tool_call_input.done", "response.output_item.done"]
    assert set(kinds[1:-2]) == {"response.custom_tool_call_input.delta"}
    added = next(e for e in events if e.type == "response.output_item.added" and e.output_index == 1)
    assert added.item.type == "custom_tool_call" and added.item.input == "" and added.item.id == patch.id
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == PATCH and done.item_id == patch.id
    assert [e.type for e in events].count("response.function_call_arguments.done") == 1
    assert_items_one_at_a_time([e.model_dump() for e in events])


def test_a_custom_call_cut_by_max_output_tokens_keeps_its_input_so_far(fake_server) -> None:
    srv = server(fake_server, CUSTOM_CALL + "<|end|>")
    cut = CUSTOM_CALL.index("hello.py")
    max_tokens = len(srv.engine.tokenizer.encode(CUSTOM_CALL[:cut], add_special_tokens=False))
    body = {"model": "fake-model", "input": "Add hello.py", "tools": [APPLY_PATCH], "tool_choice": "required",
            "max_output_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and [i["type"] for i in final["output"]] == ["custom_tool_call"]
    text = final["output"][0]["input"]
    assert PATCH.startswith(text) and text.startswith("*** Begin Patch\n*** Add File: ")
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == text


def test_bad_custom_tools_name_the_field(fake_server) -> None:
    srv = server(fake_server, "Hi.<|end|>")
    cases = [([{"type": "custom", "description": "x"}], "tools[0].name"),
             ([APPLY_PATCH, {"type": "custom", "name": "f", "format": {"type": "xml"}}], "tools[1].format")]
    for tools, param in cases:
        response = httpx.post(srv.url + "/v1/responses", timeout=30,
                              json={"model": "fake-model", "input": "x", "tools": tools})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_input_reader_decodes_the_string_however_the_arguments_are_split() -> None:
    rng = random.Random(0)
    for text in (PATCH, 'q"\\/\b\f\u0001🙂日本', ""):
        for ascii_only in (False, True):
            arguments = json.dumps({"input": text}, ensure_ascii=ascii_only)
            for _ in range(40):
                cuts = sorted(rng.sample(range(1, len(arguments)), rng.randint(0, min(12, len(arguments) - 1))))
                reader = InputReader()
                pieces = [reader.feed(arguments[a:b]) for a, b in zip([0, *cuts], [*cuts, len(arguments)], strict=True)]
                assert "".join(pieces) == text and reader.finish(arguments) == text
    other = InputReader()  # arguments shaped otherwise (no call grammar): nothing streams, nothing is lost
    assert other.feed('{"patch": "x"}') == "" and other.finish('{"patch": "x"}') == '{"patch": "x"}'
