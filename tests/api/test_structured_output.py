"""Structured output over HTTP: `response_format` (json_object, json_schema) and vLLM's guided_json /
guided_regex, parsed into the engine's StructuredOutput; a grammar the engine cannot compile is an
OpenAI-shaped 400 naming the field. The end-to-end tests drive the shared `specexec serve` process
over the random tiny pair with the openai SDK: whatever the model prefers, the grammar forces output
valid under the schema, ended by the grammar (finish_reason "stop")."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from engine.types import StructuredOutput
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

MESSAGES = [{"role": "user", "content": "Pick a color and a count."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "count"],
    "additionalProperties": False,
}


def chat_body(**fields) -> bytes:
    return json.dumps({"messages": MESSAGES, **fields}).encode()


def test_response_format_becomes_the_engines_structured_output() -> None:
    def parsed(**fields) -> StructuredOutput | None:
        request = parse_request(chat_body(**fields), ChatCompletionRequest)
        return request.to_sampling_params(16, 320).structured_output

    assert parsed() is None and parsed(response_format={"type": "text"}) is None
    assert parsed(response_format={"type": "json_object"}) == StructuredOutput("json_object")
    schema_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    assert parsed(response_format=schema_format) == StructuredOutput("json_schema", json.dumps(SCHEMA))
    assert parsed(response_format={"type": "json_schema", "json_schema": {"name": "any"}}) == StructuredOutput(
        "json_object")
    assert parsed(guided_json=SCHEMA) == StructuredOutput("json_schema", json.dumps(SCHEMA))
    assert parsed(guided_json='{"type": "string"}') == StructuredOutput("json_schema", '{"type": "string"}')
    assert parsed(guided_regex="[a-z]+") == StructuredOutput("regex", "[a-z]+")
    completion = parse_request(json.dumps({"prompt": "x", "response_format": {"type": "json_object"}}).encode(),
                               CompletionRequest)
    assert completion.to_sampling_params(16, 320).structured_output == StructuredOutput("json_object")


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "not an object"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": 5}, "guided_json"),
])
def test_a_bad_structured_output_request_is_a_400_naming_the_field(fake_server, fields, param) -> None:
    server = fake_server()
    response = httpx.post(f"{server.url}/v1/chat/completions", content=chat_body(**fields),
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_engine_checks_the_grammar_before_the_request_is_queued(fake_server) -> None:
    server = fake_server()
    response = httpx.post(f"{server.url}/v1/chat/completions", content=chat_body(guided_json="{not json"),
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "guided_json" and "not JSON" in error["message"]
    assert server.engine.requests == []  # refused before it reached the engine


@pytest.mark.slow
def test_an_uncompilable_schema_is_a_400_naming_response_format(client: openai.OpenAI, model_id: str) -> None:
    bad_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_id, messages=MESSAGES, response_format=bad_format)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "response_format"
    assert "nonsense" in error["message"] and "cannot be compiled" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt="x", extra_body={"guided_regex": "a(b"})
    assert info.value.body["param"] == "guided_regex"


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_is_valid_under_the_schema(client: openai.OpenAI, model_id: str, temperature: float) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        reply = client.chat.completions.create(model=model_id, messages=MESSAGES, response_format=response_format,
                                               temperature=temperature, seed=seed, max_tokens=200)
        choice = reply.choices[0]
        value = json.loads(choice.message.content)
        assert set(value) == {"color", "count"} and value["color"] in ("red", "green", "blue")
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
        assert choice.finish_reason == "stop"


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    ok: bool


@pytest.mark.slow
def test_the_sdk_parses_a_pydantic_model_from_the_reply(client: openai.OpenAI, model_id: str) -> None:
    completion = client.chat.completions.parse(model=model_id, messages=MESSAGES, response_format=Pick,
                                               temperature=0.7, seed=3, max_tokens=200)
    assert isinstance(completion.choices[0].message.parsed, Pick)


@pytest.mark.slow
def test_completions_take_a_regex_and_stream_it(client: openai.OpenAI, model_id: str) -> None:
    pattern = r"[a-c]{2,5}-[0-9]{3}"
    chunks = list(client.completions.create(model=model_id, prompt="ticket:", max_tokens=40, stream=True,
                                            extra_body={"guided_regex": pattern}))
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert re.fullmatch(pattern, text), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("whitespace", [None, "free"])
def test_json_whitespace_reaches_every_grammar(fake_server, whitespace) -> None:
    """Compact JSON by default (`--json-whitespace compact`), free on request: for response_format,
    guided_json and the tool calls' grammar alike."""
    from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, scripted_engine, tool_tokenizer

    fields = {} if whitespace is None else {"json_whitespace": whitespace}
    server = fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), "ok<|end|>"), **fields)
    bodies = [{"response_format": {"type": "json_object"}}, {"guided_json": SCHEMA},
              {"tools": TOOLS, "tool_choice": "required"}]
    for fields_ in bodies:
        response = httpx.post(f"{server.url}/v1/chat/completions", content=chat_body(max_tokens=2, **fields_),
                              headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        assert server.engine.requests[-1].params.structured_output.json_whitespace == (whitespace or "compact")


def test_the_json_whitespace_flag() -> None:
    import argparse

    from engine.types import ConfigError
    from server.config import ServerConfig
    from server.serve import add_server_arguments, server_config_from

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_config_from(parser.parse_args([]), None).json_whitespace == "compact"
    assert server_config_from(parser.parse_args(["--json-whitespace", "free"]), None).json_whitespace == "free"
    with pytest.raises(ConfigError, match="server.json_whitespace"):
        ServerConfig(json_whitespace="pretty")
