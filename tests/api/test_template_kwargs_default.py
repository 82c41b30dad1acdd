"""The server's --chat-template-kwargs (llama.cpp's flag; vLLM's --default-chat-template-kwargs): template
variables every chat request gets, a request's own winning; and Anthropic's `thinking` as template variables
(`disabled` -> enable_thinking false, `enabled` with budget_tokens -> a reasoning_effort), as Claude Code
sends it. Checked in the prompt the engine got, through the SDKs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from engine.types import ConfigError
from server.config import ServerConfig
from server.serve import add_server_arguments, server_config_from
from tests.api.test_reasoning_api import THINK_TEMPLATE
from tests.helpers.harmony_models import ANSWER, harmony_engine
from tests.helpers.tool_models import last_prompt, openai_client, scripted_engine, tool_tokenizer

CLOSED = "<think>\n\n</think>\n\n"  # the template's generation prompt with enable_thinking false
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(list(argv))


def think_server(fake_server: Callable, **fields: Any) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(THINK_TEMPLATE), "answer<|end|>"), **fields)


def anthropic_client(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


def test_the_flag_and_the_toml_key_become_the_servers_template_variables() -> None:
    flag = server_config_from(parse("--chat-template-kwargs", '{"enable_thinking": false}'), None)
    assert flag.chat_template_kwargs == {"enable_thinking": False}
    assert server_config_from(parse("--default-chat-template-kwargs", '{"a": 1}'), None).chat_template_kwargs == {"a": 1}
    assert server_config_from(parse(), {"chat_template_kwargs": {"enable_thinking": False}}).chat_template_kwargs == {
        "enable_thinking": False}
    with pytest.raises(ConfigError, match="--chat-template-kwargs"):
        server_config_from(parse("--chat-template-kwargs", "enable_thinking=false"), None)
    for bad in ([1], {"tools": []}, {"add_generation_prompt": False}):
        with pytest.raises(ConfigError, match="server.chat_template_kwargs"):
            ServerConfig(chat_template_kwargs=bad)  # type: ignore[arg-type]


def test_every_chat_request_gets_them_and_a_requests_own_win(fake_server) -> None:
    srv = think_server(fake_server, chat_template_kwargs={"enable_thinking": False})
    client = openai_client(srv)
    client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert last_prompt(srv).endswith(CLOSED)
    client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert not last_prompt(srv).endswith(CLOSED)
    anthropic_client(srv).messages.create(model="fake-model", max_tokens=8, messages=MESSAGES)
    assert last_prompt(srv).endswith(CLOSED)  # Anthropic clients (Claude Code) cannot send template variables


def test_anthropic_thinking_becomes_template_variables(fake_server) -> None:
    srv = think_server(fake_server)
    client = anthropic_client(srv)
    client.messages.create(model="fake-model", max_tokens=8, messages=MESSAGES, thinking={"type": "disabled"})
    assert last_prompt(srv).endswith(CLOSED)
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"}):
        client.messages.create(model="fake-model", max_tokens=8, messages=MESSAGES, thinking=thinking)
        assert not last_prompt(srv).endswith(CLOSED), thinking
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="fake-model", max_tokens=8, messages=MESSAGES,
                               thinking={"type": "enabled", "budget_tokens": -1})
    assert caught.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("budget", "effort"), [(2000, "low"), (10000, "medium"), (31999, "high")])
def test_a_thinking_budget_sets_gpt_oss_reasoning_effort(fake_server, budget: int, effort: str) -> None:
    srv = fake_server(harmony_engine(ANSWER, tokens_per_step=8))
    anthropic_client(srv).messages.create(model="fake-model", max_tokens=64, messages=MESSAGES,
                                          thinking={"type": "enabled", "budget_tokens": budget})
    assert f"Reasoning: {effort}" in last_prompt(srv)
