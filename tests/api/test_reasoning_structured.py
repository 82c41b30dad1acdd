"""Structured output on a reasoning model (server/reasoning.py `reasoning_first`): the model thinks first,
and its answer after the `<think>` block obeys the request's grammar; the block goes to
`reasoning_content` (OpenAI), `thinking` (Ollama) or a reasoning item (Responses), the answer to the content.

The wiring: which grammar reaches the engine (a scripted FakeEngine records it) for templates with and
without think tags, a prompt that opened the block or closed an empty one (`enable_thinking: false`), and
each surface that asks for a grammar. End to end: the thinking bigram model (tests/helpers/think_model.py),
which writes `<think>Pick red.</think>{` where it may, on the real engine and app, through the openai and
ollama SDKs: its reasoning comes back apart and its answer is valid under the schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.types import ReasoningBlock, StructuredOutput
from server.reasoning import Opening, prompt_reasoning, reasoning_first
from tests.api.test_reasoning_api import OPENED_TEMPLATE, THINK_TEMPLATE
from tests.helpers.think_model import REASONING, make_think_pair
from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as oai

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "count"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Pick a color and a count."}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
PICK_TOOL = [{"type": "function", "function": {"name": "pick", "description": "Pick.", "parameters": SCHEMA}}]


def test_the_prompt_tells_how_the_block_begins() -> None:
    assert prompt_reasoning("<|assistant|>\n") is Opening.FREE
    assert prompt_reasoning("<|assistant|>\n<think>\n") is Opening.OPENED
    assert prompt_reasoning("<|assistant|>\n<think>\n\n</think>\n\n") is Opening.OFF
    assert prompt_reasoning("<|assistant|>\n", thinking=False) is Opening.OFF
    assert prompt_reasoning("<|assistant|>\n<think>\n", thinking=False) is Opening.OPENED  # the template opened it


def test_reasoning_first_wraps_the_spec_unless_thinking_is_off() -> None:
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), json_whitespace="free")
    assert reasoning_first(spec, Opening.OFF) is spec
    assert reasoning_first(spec, Opening.FREE) == StructuredOutput(
        "json_schema", json.dumps(SCHEMA), json_whitespace="free", reasoning=ReasoningBlock("<think>", "</think>"))
    assert reasoning_first(spec, Opening.OPENED).reasoning == ReasoningBlock("<think>", "</think>", opened=True)


# -- which grammar reaches the engine ------------------------------------------------------------


def engine_grammar(fake_server: Callable, template: str, path: str = "/v1/chat/completions",
                   **body: Any) -> StructuredOutput | None:
    srv = fake_server(scripted_engine(tool_tokenizer(template), "{}<|end|>"))
    fields = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    response = httpx.post(srv.url + path, json={"model": "fake-model", "max_tokens": 4, **fields, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return srv.engine.requests[-1].params.structured_output


@pytest.mark.parametrize(("template", "body", "block"), [
    (THINK_TEMPLATE, {}, ReasoningBlock()),
    (THINK_TEMPLATE, OFF, None),  # the template closed an empty block
    (OPENED_TEMPLATE, {}, ReasoningBlock(opened=True)),
    (OPENED_TEMPLATE, OFF, ReasoningBlock(opened=True)),  # the template opened the block all the same
    (HERMES_TEMPLATE, {}, None),  # no think tags
], ids=["think", "thinking-off", "opened", "opened-thinking-off", "no-tags"])
def test_the_chat_grammar_follows_the_prompt(fake_server, template: str, body: dict, block) -> None:
    for asked in ({"response_format": RESPONSE_FORMAT}, {"response_format": {"type": "json_object"}},
                  {"guided_json": SCHEMA}, {"guided_regex": "[a-z]+"}, {"tools": TOOLS, "tool_choice": "required"}):
        grammar = engine_grammar(fake_server, template, **asked, **body)
        assert grammar is not None and grammar.reasoning == block, asked


def test_other_requests_keep_their_grammar(fake_server) -> None:
    assert engine_grammar(fake_server, THINK_TEMPLATE, "/v1/completions", response_format=RESPONSE_FORMAT).reasoning \
        is None
    assert engine_grammar(fake_server, THINK_TEMPLATE) is None  # no grammar asked for
    srv = fake_server(scripted_engine(tool_tokenizer(THINK_TEMPLATE), "{}<|end|>"), reasoning_format="none")
    oai(srv).chat.completions.create(model="fake-model", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=4)
    assert srv.engine.requests[-1].params.structured_output.reasoning is None


def test_ollama_and_responses_grammars_take_the_block(fake_server) -> None:
    srv = fake_server(scripted_engine(tool_tokenizer(THINK_TEMPLATE), "{}<|end|>"))
    client = ollama.Client(host=srv.url, timeout=60)
    client.chat(model="fake-model", messages=MESSAGES, format=SCHEMA, options={"num_predict": 4})
    assert srv.engine.requests[-1].params.structured_output.reasoning == ReasoningBlock()
    client.chat(model="fake-model", messages=MESSAGES, format="json", think=False, options={"num_predict": 4})
    assert srv.engine.requests[-1].params.structured_output.reasoning is None
    oai(srv).responses.create(model="fake-model", input="hi", max_output_tokens=16, text={"format": {
        "type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}})
    assert srv.engine.requests[-1].params.structured_output.reasoning == ReasoningBlock()


# -- end to end: the thinking bigram model on the real engine --------------------------------------


@pytest.fixture(scope="module")
def think_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engine.runtime import Engine

    target, draft = make_think_pair(tmp_path_factory.mktemp("think"), max_positions=2048)
    return Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(draft), name="tiny-think"),
                                    speculation=SpeculationConfig(budget=16), limits=LimitsConfig(max_context=2048)))


@pytest.fixture
def think_server(fake_server: Callable, think_engine: Any) -> Any:
    srv = fake_server(think_engine)
    assert srv.state.prompt.reasoning  # the template names the tags
    return srv


def valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_openai_reasoning_then_a_valid_answer_whole_and_streamed(think_server: Any) -> None:
    client = oai(think_server)
    kwargs: dict[str, Any] = {"model": "tiny-think", "messages": MESSAGES, "response_format": RESPONSE_FORMAT,
                              "temperature": 0, "max_tokens": 48}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.model_extra or {}).get("reasoning_content") == REASONING
    answer = valid(choice.message.content)
    assert choice.finish_reason == "stop"
    reasoning, content = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(c.delta.content or "")
    assert ("".join(reasoning), valid("".join(content))) == (REASONING, answer)


def test_openai_thinking_off_answers_at_once(think_server: Any) -> None:
    choice = oai(think_server).chat.completions.create(
        model="tiny-think", messages=MESSAGES, response_format=RESPONSE_FORMAT, temperature=0, max_tokens=48,
        extra_body=OFF).choices[0]
    assert "reasoning_content" not in (choice.message.model_extra or {})
    valid(choice.message.content)


def test_ollama_format_with_thinking(think_server: Any) -> None:
    client = ollama.Client(host=think_server.url, timeout=120)
    options = {"temperature": 0, "num_predict": 48}
    reply = client.chat(model="tiny-think", messages=MESSAGES, format=SCHEMA, options=options)
    assert reply.message.thinking == REASONING
    valid(reply.message.content)
    reply = client.chat(model="tiny-think", messages=MESSAGES, format=SCHEMA, think=False, options=options)
    assert reply.message.thinking is None
    valid(reply.message.content)


def test_responses_text_format_with_a_reasoning_item(think_server: Any) -> None:
    response = oai(think_server).responses.create(model="tiny-think", input="Pick a color.", temperature=0,
                                                  max_output_tokens=48, text={"format": {
                                                      "type": "json_schema", "name": "pick", "schema": SCHEMA,
                                                      "strict": True}})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [part.text for part in response.output[0].content] == [REASONING]
    valid(response.output_text)


def test_forced_tool_call_after_reasoning(fake_server: Callable, think_engine: Any, tmp_path: Path) -> None:
    template = tmp_path / "think_tools.jinja"
    template.write_text(THINK_TEMPLATE)
    srv = fake_server(think_engine, chat_template=str(template))
    choice = oai(srv).chat.completions.create(model="tiny-think", messages=MESSAGES, tools=PICK_TOOL,
                                              tool_choice="required", temperature=0, max_tokens=128).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.model_extra or {}).get("reasoning_content") == REASONING
    [call] = choice.message.tool_calls
    assert call.function.name == "pick"
    valid(call.function.arguments)
