"""Output cut off by max_tokens right after a tool-call marker's first character: every surface drops the
partial markup, as the OpenAI one does (tests/api/test_toolcalls_api.py), since each reads the reply with
its finish reason (server/generation.py, Generation.finish_deltas)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, scripted_engine, tool_tokenizer

TEXT = "Let me check."
SCRIPT = TEXT + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'


def cut_server(fake_server: Callable) -> tuple[Any, int]:
    """A server whose model writes SCRIPT, and the max_tokens that cut it right after the marker's "<"."""
    srv = fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), SCRIPT))
    return srv, len(srv.engine.tokenizer.encode(TEXT + "<", add_special_tokens=False))


def test_anthropic_drops_a_marker_cut_off(fake_server) -> None:
    srv, max_tokens = cut_server(fake_server)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {"model": "fake-model", "max_tokens": max_tokens, "tools": tools,
            "messages": [{"role": "user", "content": "Weather?"}]}
    reply = httpx.post(srv.url + "/v1/messages", json=body, timeout=30).json()
    assert reply["stop_reason"] == "max_tokens"
    assert [block["text"] for block in reply["content"] if block["type"] == "text"] == [TEXT]


def test_ollama_drops_a_marker_cut_off(fake_server) -> None:
    srv, max_tokens = cut_server(fake_server)
    body = {"model": "fake-model", "stream": False, "tools": TOOLS, "options": {"num_predict": max_tokens},
            "messages": [{"role": "user", "content": "Weather?"}]}
    reply = httpx.post(srv.url + "/api/chat", json=body, timeout=30).json()
    assert reply["done_reason"] == "length" and reply["message"]["content"] == TEXT
