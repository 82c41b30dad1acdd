"""Ollama's `think` (server/ollama_api/request.py) through the ollama python client: true (or a level)
asks the template to think and returns `thinking` apart; false asks it not to and returns none (what the
model writes anyway is dropped); left out keeps the template's default with `thinking` apart; a past
assistant turn's `thinking` reaches templates that render it; /api/show reports the capability."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import ollama
import pytest

from tests.api.test_reasoning_api import SCRIPT, THINK_TEMPLATE
from tests.api.test_responses_reasoning import REPLAY_TEMPLATE
from tests.helpers.tool_models import scripted_engine, tool_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
CLOSED = "<think>\n\n</think>\n\n"  # THINK_TEMPLATE's generation prompt when enable_thinking is false
# names the level, as GPT-OSS's template does with reasoning_effort
LEVEL_TEMPLATE = THINK_TEMPLATE.replace("{%- for m in messages %}",
                                        "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n"
                                        "{% endif %}{%- for m in messages %}", 1)


def serve(fake_server: Callable, script: str = SCRIPT, template: str = THINK_TEMPLATE) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(template), script))


def client(srv: Any) -> ollama.Client:
    return ollama.Client(host=srv.url, timeout=60)


def prompt(srv: Any) -> str:
    return srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)


def chat_both(srv: Any, **kwargs: Any) -> tuple[Any, str, str]:
    """The whole reply's message, and the streamed (thinking, content) joined."""
    reply = client(srv).chat(model="fake-model", messages=MESSAGES, stream=False, **kwargs)
    parts = list(client(srv).chat(model="fake-model", messages=MESSAGES, stream=True, **kwargs))
    return (reply.message, "".join(p.message.thinking or "" for p in parts),
            "".join(p.message.content or "" for p in parts))


@pytest.mark.parametrize("think", [True, None])
def test_think_true_and_unset_return_thinking_apart(fake_server, think: bool | None) -> None:
    srv = serve(fake_server)
    message, thinking, content = chat_both(srv, think=think)
    assert (message.thinking, message.content) == ("a b", "answer")
    assert (thinking, content) == ("a b", "answer")
    assert not prompt(srv).endswith(CLOSED)


def test_think_false_asks_the_template_not_to_think(fake_server) -> None:
    srv = serve(fake_server, "answer<|end|>")
    message, thinking, content = chat_both(srv, think=False)
    assert prompt(srv).endswith(CLOSED)
    assert (message.thinking, message.content, thinking, content) == (None, "answer", "", "answer")


def test_think_false_drops_reasoning_written_anyway(fake_server) -> None:
    message, thinking, content = chat_both(serve(fake_server), think=False)
    assert (message.thinking, message.content, thinking, content) == (None, "answer", "", "answer")


def test_think_level_reaches_the_template(fake_server) -> None:
    srv = serve(fake_server, template=LEVEL_TEMPLATE)
    reply = client(srv).chat(model="fake-model", messages=MESSAGES, think="high")
    assert (reply.message.thinking, reply.message.content) == ("a b", "answer")
    assert prompt(srv).startswith("Reasoning: high\n") and not prompt(srv).endswith(CLOSED)
    client(srv).chat(model="fake-model", messages=MESSAGES)
    assert not prompt(srv).startswith("Reasoning:")


def test_bad_think_value_is_a_400_in_ollamas_shape(fake_server) -> None:
    reply = httpx.post(serve(fake_server).url + "/api/chat", timeout=30,
                       json={"model": "fake-model", "messages": MESSAGES, "think": "extreme", "stream": False})
    assert reply.status_code == 400 and "think" in reply.json()["error"]


def test_generate_think(fake_server) -> None:
    srv = serve(fake_server)
    reply = client(srv).generate(model="fake-model", prompt="hi", think=True)
    assert (reply.thinking, reply.response) == ("a b", "answer")
    reply = client(srv).generate(model="fake-model", prompt="hi", think=False)
    assert (reply.thinking, reply.response) == (None, "answer") and prompt(srv).endswith(CLOSED)
    raw = client(srv).generate(model="fake-model", prompt="hi", raw=True, think=False)
    assert raw.response == "<think>a b</think>answer"  # no template, nothing read apart


def test_past_thinking_reaches_the_template(fake_server) -> None:
    srv = serve(fake_server, template=REPLAY_TEMPLATE)
    history = MESSAGES + [{"role": "assistant", "content": "answer", "thinking": "a b"},
                          {"role": "user", "content": "more"}]
    client(srv).chat(model="fake-model", messages=history, think=True)
    assert "<|assistant|>\n<think>a b</think>answer<|end|>" in prompt(srv)


def test_show_reports_thinking(fake_server) -> None:
    assert "thinking" in client(serve(fake_server)).show("fake-model").capabilities
