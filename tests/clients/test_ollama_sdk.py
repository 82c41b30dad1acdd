"""The `ollama` Python package against a running `specexec serve` (tests/clients/conftest.py): list, show,
ps, chat and generate (streamed and not), raw generate, a `format` schema, tools and a tool round trip."""

from __future__ import annotations

from typing import Any

import ollama
import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import MODEL

GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def client(clients_server: Any) -> ollama.Client:
    return ollama.Client(host=clients_server.url, timeout=300)


def test_list_show_and_ps(client: ollama.Client) -> None:
    models = client.list().models
    assert [m.model for m in models] == [f"{MODEL}:latest"] and models[0].size > 0
    assert models[0].details.family == "llama" and models[0].details.format == "safetensors"
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools"] and "<tool_call>" in shown.template
    assert shown.modelinfo["llama.context_length"] == 2048 and shown.modelinfo["general.parameter_count"] > 0
    running = client.ps().models
    assert running[0].model == f"{MODEL}:latest" and running[0].context_length == 2048


def test_chat_streamed_and_not_give_the_same_greedy_text(client: ollama.Client) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Write a loop."}]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0 and whole.eval_duration > 0
    parts = list(client.chat(model=f"{MODEL}:latest", messages=messages, options=GREEDY, stream=True))
    assert "".join(part.message.content or "" for part in parts) == whole.message.content
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count and not any(p.done for p in parts[:-1])


def test_generate_streamed_not_and_raw(client: ollama.Client) -> None:
    whole = client.generate(model=MODEL, prompt="def add(a, b):", options=GREEDY)
    parts = list(client.generate(model=MODEL, prompt="def add(a, b):", options=GREEDY, stream=True))
    assert "".join(part.response for part in parts) == whole.response and parts[-1].done
    raw = client.generate(model=MODEL, prompt="def add(a, b):", raw=True, options=GREEDY)
    assert raw.done and raw.prompt_eval_count < whole.prompt_eval_count  # no template around it


def test_format_schema_gives_a_valid_object(client: ollama.Client) -> None:
    class City(BaseModel):
        name: str = Field(pattern="^[A-Za-z ]{1,12}$")
        sunny: bool

    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "A city?"}],
                        format=City.model_json_schema(), options={"temperature": 0, "num_predict": 200})
    assert reply.done_reason == "stop"
    City.model_validate_json(reply.message.content)


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name
    """
    return f"21 C in {city}"


def test_tools_and_a_tool_round_trip(client: ollama.Client) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat(model=MODEL, messages=messages, tools=[get_weather], options=GREEDY)
    assert reply.done and reply.done_reason in ("stop", "length")
    for call in reply.message.tool_calls or []:  # a random model may or may not call
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    messages += [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": get_weather("Paris"), "tool_name": "get_weather"}]
    after = client.chat(model=MODEL, messages=messages, tools=[get_weather], options=GREEDY)
    assert after.done and after.prompt_eval_count > reply.prompt_eval_count


def test_errors_are_response_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3.2", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404 and "llama3.2" in missing.value.error
    with pytest.raises(ollama.ResponseError) as embed:
        client.embed(model=MODEL, input="x")
    assert embed.value.status_code == 400
    assert client.pull(MODEL).status == "success"
