"""Large and slow bodies: a size cap (413), a body stall timeout (408), prompts that cannot fit refused
before tokenizing, and tokenization off the event loop (/health answers meanwhile)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.api.test_api_app import CHAT, PROMPT, assert_openai_error
from tests.helpers.fake_engine import FakeEngine


def test_body_over_the_cap_is_413_from_content_length(fake_server) -> None:
    srv = fake_server(max_body_bytes=20_000)
    body = {**PROMPT, "prompt": "x" * 30_000}
    response = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    error = assert_openai_error(response, 413, "invalid_request_error")
    assert error["code"] == "request_too_large" and "20000 bytes" in error["message"]
    small = {**PROMPT, "prompt": "x" * 100}
    assert httpx.post(srv.url + "/v1/completions", json=small, timeout=30).status_code == 200


def test_chunked_body_over_the_cap_is_413(fake_server) -> None:
    srv = fake_server(max_body_bytes=20_000)
    payload = json.dumps({**PROMPT, "prompt": "x" * 30_000}).encode()

    def pieces() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
        for start in range(0, len(payload), 4096):
            yield payload[start : start + 4096]

    response = httpx.post(srv.url + "/v1/completions", content=pieces(), headers={"content-type": "application/json"},
                          timeout=30)
    assert_openai_error(response, 413)
    assert srv.engine.requests == []


def test_stalled_body_is_408(fake_server) -> None:
    srv = fake_server(read_timeout=1.0)
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        reply = b""
        while b"\r\n\r\n" not in reply:  # the server answers by itself; the socket timeout bounds the wait
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_prompt_that_cannot_fit_is_refused_without_tokenizing(fake_server, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(max_context=64)
    srv = fake_server(engine)
    calls: list[str] = []
    real_encode = srv.state.prompt.encode  # the prompt's tokenizing (server/prompt.py)
    monkeypatch.setattr(srv.state.prompt, "encode", lambda text, *args: calls.append(text) or real_encode(text, *args))
    limit = srv.state.prompt.max_prompt_chars
    for path, body, param in (("/v1/completions", {**PROMPT, "prompt": "y" * (limit + 1)}, "prompt"),
                              ("/v1/chat/completions",
                               {**CHAT, "messages": [{"role": "user", "content": "y" * (limit + 1)}]}, "messages")):
        error = assert_openai_error(httpx.post(srv.url + path, json=body, timeout=30), 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert "maximum context length is 64 tokens" in error["message"]
    assert calls == []
    # a prompt below the character bound is tokenized and checked exactly, as before
    error = assert_openai_error(httpx.post(srv.url + "/v1/completions", json={**PROMPT, "prompt": "word " * 100},
                                           timeout=30), 400)
    assert error["code"] == "context_length_exceeded" and len(calls) == 1


@pytest.mark.parametrize("chat", [False, True])
def test_health_answers_while_a_big_prompt_is_tokenized(fake_server, monkeypatch: pytest.MonkeyPatch,
                                                        chat: bool) -> None:
    engine = FakeEngine(max_context=10**7)
    srv = fake_server(engine)
    started, may_finish = threading.Event(), threading.Event()
    owner = engine.tokenizer if chat else srv.state.prompt  # the chat template, or the prompt's tokenizing
    method = "apply_chat_template" if chat else "encode"
    real = getattr(owner, method)

    def slow(*args, **kwargs):  # stands for seconds of tokenizing / rendering a multi-megabyte prompt
        started.set()
        assert may_finish.wait(60)  # ends only after /health answered (or the health request gave up)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, slow)
    big = "word " * 200_000  # 1 MB
    body = {**CHAT, "messages": [{"role": "user", "content": big}]} if chat else {**PROMPT, "prompt": big}
    result: list[httpx.Response] = []
    path = "/v1/chat/completions" if chat else "/v1/completions"
    worker = threading.Thread(target=lambda: result.append(httpx.post(srv.url + path, json=body, timeout=60)))
    worker.start()
    try:
        assert started.wait(60)
        # a loop blocked by the tokenizer could not answer before may_finish is set: the request times out
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 200
    finally:
        may_finish.set()
    worker.join(60)
    assert result and result[0].status_code == 200, result
