"""One generation path, a thin adapter per API: the same prompt and sampling give the same tokens on every
surface (OpenAI chat, Responses, Anthropic Messages, Ollama chat and generate; completions and Ollama's raw
generate), greedy and seeded, and the same forced tool call under chat's `required` and Anthropic's `any`."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import ollama
import openai
import pytest

from tests.clients.conftest import MODEL
from tests.clients.test_anthropic_sdk import WEATHER

SYSTEM, USER = "Answer briefly.", "Write a function that reads a file."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def clients(clients_server: Any) -> tuple[openai.OpenAI, anthropic.Anthropic, ollama.Client]:
    url = clients_server.url
    return (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300),
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300),
            ollama.Client(host=url, timeout=300))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_chat_surfaces_give_the_same_text(clients: Any, sampling: dict[str, Any]) -> None:
    oai, claude, llama = clients
    chat = oai.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], **sampling)
    text = chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0
    message = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM,
                                     messages=[{"role": "user", "content": USER}], extra_body=sampling)
    assert message.content[0].text == text and message.usage.output_tokens == chat.usage.completion_tokens
    options = {"num_predict": MAX_TOKENS, **sampling}
    ollama_chat = llama.chat(model=MODEL, options=options, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    assert ollama_chat.message.content == text and ollama_chat.eval_count == chat.usage.completion_tokens
    generated = llama.generate(model=MODEL, system=SYSTEM, prompt=USER, options=options)
    assert generated.response == text
    response = oai.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=MAX_TOKENS,
                                    extra_body={"seed": sampling.get("seed")}, temperature=sampling["temperature"])
    assert response.output_text == text


def test_completion_and_raw_generate_give_the_same_text(clients: Any) -> None:
    oai, _, llama = clients
    prompt = "def read_lines(path):\n    with open(path) as f:\n"
    completion = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    raw = llama.generate(model=MODEL, prompt=prompt, raw=True, options={"num_predict": MAX_TOKENS, "temperature": 0})
    assert raw.response == completion.choices[0].text and raw.eval_count == completion.usage.completion_tokens


def test_forced_tool_calls_are_the_same(clients: Any) -> None:
    oai, claude, _ = clients
    question = [{"role": "user", "content": "Weather in Paris?"}]
    chat = oai.chat.completions.create(model=MODEL, messages=question, max_tokens=200, temperature=0,
                                       tool_choice="required", parallel_tool_calls=False, tools=[
                                           {"type": "function", "function": {"name": WEATHER["name"],
                                                                             "description": WEATHER["description"],
                                                                             "parameters": WEATHER["input_schema"]}}])
    call = chat.choices[0].message.tool_calls[0]
    message = claude.messages.create(model=MODEL, messages=question, max_tokens=200, tools=[WEATHER],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     extra_body={"temperature": 0})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [(use.name, use.input) for use in uses] == [(call.function.name, json.loads(call.function.arguments))]
    assert message.usage.output_tokens == chat.usage.completion_tokens
