"""Tool calls, the Responses API and LangChain on a real (random, tiny) Qwen2 model with a Qwen2.5-style
chat template that renders tools (tests/helpers/tool_models.py), served by the real app and engine.

A random model writes whatever its logits say; the calls' grammar is what makes every forced request
end in a valid call: finish_reason "tool_calls", arguments valid under the function's schema
(jsonschema), streamed and not, greedy and sampled. The tools' strings are bounded (a pattern): under
a free string a random model may go on writing characters until max_tokens, where a trained model
closes the string; the grammar allows both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from tests.helpers.tiny_models import make_tiny_pair
from tests.helpers.tool_models import HERMES_TEMPLATE

WORD = {"type": "string", "pattern": "^[A-Za-z /_]{1,16}$"}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": WORD, "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone.",
        "parameters": {"type": "object", "properties": {"tz": WORD, "dst": {"type": "boolean"}},
                       "required": ["tz", "dst"]}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# (tool_choice, parallel_tool_calls): with parallel calls allowed a random model may go on calling until
# max_tokens (test_parallel_required_calls_are_valid_up_to_the_limit)
CHOICES: list[tuple[Any, bool | None]] = [("required", False), ({"type": "function", "function": {"name": "get_weather"}}, None),
                                          ({"type": "function", "function": {"name": "get_time"}}, True)]
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engine.runtime import Engine

    target, draft = make_tiny_pair(tmp_path_factory.mktemp("qwen-tools"), arch="qwen2", draft="noisy", seed=5,
                                   max_positions=2048)
    return Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(draft), name="tiny-qwen"),
                                    speculation=SpeculationConfig(budget=16), limits=LimitsConfig(max_context=2048)))


@pytest.fixture
def qwen_server(fake_server: Callable, qwen_engine: Any, tmp_path: Path) -> Any:
    template = tmp_path / "qwen_tools.jinja"
    template.write_text(HERMES_TEMPLATE)
    srv = fake_server(qwen_engine, chat_template=str(template))
    assert srv.state.prompt.tools.format.name == "hermes"
    return srv


def client_for(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_calls(calls: list[tuple[str, str]], named: str | None) -> None:
    assert calls
    for name, arguments in calls:
        assert name in SCHEMAS and (named is None or name == named)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_forced_tool_calls_are_valid_streamed_and_not(qwen_server: Any) -> None:
    client = client_for(qwen_server)
    for choice, parallel in CHOICES:
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        for sampling in SAMPLING:
            request = {"model": "tiny-qwen", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                       "max_tokens": 400, **sampling}
            if parallel is not None:
                request["parallel_tool_calls"] = parallel
            full = client.chat.completions.create(**request).choices[0]
            assert full.finish_reason == "tool_calls", (choice, sampling, full)
            check_calls([(c.function.name, c.function.arguments) for c in full.message.tool_calls], named)
            state = ChatCompletionStreamState()
            for chunk in client.chat.completions.create(stream=True, **request):
                state.handle_chunk(chunk)
            streamed = state.get_final_completion().choices[0]
            assert streamed.finish_reason == "tool_calls", (choice, sampling, streamed)
            check_calls([(c.function.name, c.function.arguments) for c in streamed.message.tool_calls], named)
            if sampling.get("seed") is not None or sampling["temperature"] == 0:  # the same request, the same call
                assert [c.function.arguments for c in streamed.message.tool_calls] == [
                    c.function.arguments for c in full.message.tool_calls]


def test_parallel_required_calls_are_valid_up_to_the_limit(qwen_server: Any) -> None:
    full = client_for(qwen_server).chat.completions.create(
        model="tiny-qwen", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
    check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], None)


def test_langchain_with_structured_output_returns_the_pydantic_object(qwen_server: Any) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(pattern=WORD["pattern"])
        unit: Literal["c", "f"]

    llm = langchain_openai.ChatOpenAI(base_url=qwen_server.url + "/v1", api_key="unused", model="tiny-qwen",
                                      temperature=0, max_tokens=300, max_retries=0)
    answer = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Paris?")
    assert isinstance(answer, Weather) and answer.unit in ("c", "f")


def test_responses_api_on_the_real_model(qwen_server: Any) -> None:
    client = client_for(qwen_server)
    text = client.responses.create(model="tiny-qwen", input="Say hello.", temperature=0, max_output_tokens=24)
    assert text.status in ("completed", "incomplete") and isinstance(text.output_text, str)
    with client.responses.stream(model="tiny-qwen", input="Say hello.", temperature=0, max_output_tokens=24) as s:
        events = [event.type for event in s]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    first = client.responses.create(model="tiny-qwen", input="Weather in Paris?", tools=tools,
                                    tool_choice="required", temperature=0, max_output_tokens=400)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls
    check_calls([(call.name, call.arguments) for call in calls], None)
    second = client.responses.create(
        model="tiny-qwen", previous_response_id=first.id, tools=tools, temperature=0, max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"} for call in calls])
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > first.usage.input_tokens


VERCEL_AI = Path(__file__).resolve().parents[1] / "clients" / "vercel_ai"


def test_vercel_ai_sdk_default_provider(qwen_server: Any) -> None:
    """`openai(id)` of @ai-sdk/openai (the Responses API): generateText, streamText, a forced tool call and
    the tool result round trip (tests/clients/vercel_ai/check.mjs)."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (VERCEL_AI / "node_modules" / "ai").is_dir():
        pytest.skip("the Vercel AI SDK is not installed: npm install --prefix tests/clients/vercel_ai")
    result = subprocess.run(["node", "check.mjs", qwen_server.url + "/v1", "tiny-qwen"], cwd=VERCEL_AI,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = {case["case"]: case for case in map(json.loads, result.stdout.splitlines())}
    assert cases["generateText"]["finishReason"] in ("stop", "length")
    assert cases["generateText"]["usage"]["inputTokens"] > 0
    assert "".join(cases["streamText"]["deltas"]) == cases["streamText"]["text"]
    calls = cases["toolCall"]["toolCalls"]
    assert cases["toolCall"]["finishReason"] == "tool-calls" and [c["toolName"] for c in calls] == ["get_weather"]
    jsonschema.validate(calls[0]["input"], SCHEMAS["get_weather"] | {"required": ["city", "unit"]})
    assert cases["toolResult"]["finishReason"] in ("stop", "length")
    items = client_for(qwen_server).responses.input_items.list(cases["toolResult"]["responseId"]).data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == items[2].call_id == calls[0]["toolCallId"] and "21 C, sunny" in str(items[2].output)
