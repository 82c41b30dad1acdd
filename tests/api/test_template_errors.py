"""A chat template that fails on a request's messages is the request's fault: a 400 in its API's own error
shape, naming `messages` (as vLLM does for any error the template raises), and the server goes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers.tool_models import scripted_engine, tool_tokenizer

# raise_exception on one content (TemplateError); arithmetic on another (a TypeError inside the sandbox)
TEMPLATE = """\
{%- for m in messages %}
{%- if m.content == 'raise' %}{{ raise_exception('this template refuses it') }}{% endif %}
{%- if m.content == 'add' %}{{ m.content + 1 }}{% endif %}
<|{{ m.role }}|>
{{ m.content }}<|end|>
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


@pytest.fixture()
def srv(fake_server: Callable) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(TEMPLATE), "fine<|end|>"))


@pytest.mark.parametrize("content", ["raise", "add"])
def test_a_template_failing_on_the_messages_is_a_400_and_the_server_goes_on(srv, content) -> None:
    openai_body = {"model": "fake-model", "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(srv.url + "/v1/chat/completions", json=openai_body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]
    anthropic_body = {"model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(srv.url + "/v1/messages", json=anthropic_body, timeout=30)
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    reply = httpx.post(srv.url + "/api/chat", json={"model": "fake-model", "stream": False,
                                                     "messages": [{"role": "user", "content": content}]}, timeout=30)
    assert reply.status_code == 400 and "chat template" in reply.json()["error"], reply.text
    fine = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
    reply = httpx.post(srv.url + "/v1/chat/completions", json=fine, timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "fine"
