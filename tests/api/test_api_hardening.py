"""Inputs that once stalled the server or ended in a 500 (issue 29): huge integers, bodies of millions of
values, a client leaving mid-upload, /infill text tokenized before it was cut, logit_bias overflow,
chat text rendered before it was bounded, long stop strings, non-ASCII API keys."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from server.errors import APIError
from server.fim import FimFormat, fit
from server.json_body import MAX_JSON_VALUES, check_json_size, load_json_object
from server.protocol import MAX_STOP_CHARS
from tests.api.test_api_app import CHAT, PROMPT, assert_openai_error
from tests.api.test_fim import qwen_tokenizer
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import scripted_engine

JSON = {"content-type": "application/json"}


def post(url: str, path: str, raw: bytes, **kwargs: object) -> httpx.Response:
    return httpx.post(url + path, content=raw, headers=JSON, timeout=30, **kwargs)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/infill"])
def test_an_integer_over_4300_digits_is_400(fake_server, path: str) -> None:
    srv = fake_server()
    raw = b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "seed": 1' + b"0" * 5000 + b"}"
    error = assert_openai_error(post(srv.url, path, raw), 400, "invalid_request_error")
    assert "4300 digits" in error["message"] and "set_int_max_str_digits" not in error["message"]


def test_a_body_of_too_many_values_is_400_before_parsing(fake_server) -> None:
    srv = fake_server()
    raw = b'{"prompt": "x", "junk": [' + b",".join([b"1"] * (MAX_JSON_VALUES + 10)) + b"]}"
    error = assert_openai_error(post(srv.url, "/v1/completions", raw), 400)
    assert error["code"] == "too_many_json_values"
    ids = {**PROMPT, "prompt": list(range(1, 201)), "max_tokens": 2}  # token-id prompts stay far below
    assert httpx.post(srv.url + "/v1/completions", json=ids, timeout=30).status_code == 200


def test_check_json_size_bound() -> None:
    check_json_size(b"[" + b"1," * (MAX_JSON_VALUES - 2) + b"1]")  # MAX_JSON_VALUES - 1 commas and brackets
    with pytest.raises(APIError):
        check_json_size(b"[" + b"1," * (MAX_JSON_VALUES - 1) + b"1]")
    with pytest.raises(APIError):
        load_json_object(b'{"a": "' + b"," * MAX_JSON_VALUES + b'"}')  # counted inside strings too


def test_a_client_leaving_mid_upload_is_no_error(fake_server, caplog: pytest.LogCaptureFixture) -> None:
    srv = fake_server()
    port = int(srv.url.rsplit(":", 1)[1])
    with caplog.at_level(logging.ERROR):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000)
            time.sleep(0.3)
        time.sleep(0.5)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert srv.state.metrics.rejected.labels("completions", "499")._value.get() == 1


def test_infill_cuts_every_text_field_before_tokenizing(fake_server, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = qwen_tokenizer()
    engine = scripted_engine(tokenizer, "a + b<|fim_pad|>", max_context=128)
    srv = fake_server(engine)
    limit = srv.state.prompt.max_prompt_chars
    lengths: list[int] = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: lengths.append(len(text)) or real(text, **kw))
    huge = "def f(x):\n    return x\n" * 40_000  # ~1 MB per field
    body = {"input_prefix": huge, "input_suffix": huge, "prompt": huge, "n_predict": 4,
            "input_extra": [{"filename": "a.py", "text": huge}, {"filename": "b.py", "text": huge}] + [
                {"filename": f"{i}.py", "text": ""} for i in range(10_000)]}
    r = httpx.post(f"{srv.url}/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] is True
    assert max(lengths) <= limit and sum(lengths) <= 4 * limit, (max(lengths), sum(lengths), limit)


def test_infill_cut_keeps_what_the_token_cut_keeps(fake_server) -> None:
    """The character cut only drops text that the token cut (server/fim.py `fit`) drops anyway."""
    tokenizer = qwen_tokenizer()
    engine = scripted_engine(tokenizer, "a + b<|fim_pad|>", max_context=128)
    srv = fake_server(engine)
    limit = srv.state.prompt.max_prompt_chars
    code = "def f(x):\n    return x + 1\n"
    prefix, suffix = code * (2 * limit // len(code)), "\n" + code * (2 * limit // len(code))
    extra = [{"filename": "a.py", "text": code * (2 * limit // len(code))}]
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "n_predict": 4}
    assert httpx.post(f"{srv.url}/infill", json=body, timeout=60).status_code == 200
    fim = FimFormat.detect(tokenizer)
    parts, truncated = fit(fim.parts(prefix, suffix, "", [("a.py", extra[0]["text"])]), 128 - 4)  # all tokenized
    assert truncated and engine.requests[-1].prompt_ids == fim.assemble(parts)


@pytest.mark.parametrize("bias", [10**400, -(10**30)])
def test_infill_logit_bias_too_large_for_a_float_is_400(fake_server, bias: int) -> None:
    engine = scripted_engine(qwen_tokenizer(), "a + b<|fim_pad|>")
    srv = fake_server(engine)
    body = {"input_prefix": "def f(", "n_predict": 2, "logit_bias": [[5, bias]]}
    error = assert_openai_error(httpx.post(f"{srv.url}/infill", json=body, timeout=30), 400)
    assert error["param"] == "logit_bias"


def test_chat_text_is_bounded_before_the_template_renders_it(fake_server, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(max_context=64)
    srv = fake_server(engine)
    rendered: list[int] = []
    real = engine.tokenizer.apply_chat_template
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template",
                        lambda *a, **kw: rendered.append(1) or real(*a, **kw))
    limit = srv.state.prompt.max_prompt_chars
    many = [{"role": "user", "content": "y" * 100}] * (limit // 100 + 1)  # small messages, too many in all
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * (limit + 1)}}]
    for messages in (many, [{"role": "assistant", "content": None, "tool_calls": calls}]):
        error = assert_openai_error(httpx.post(srv.url + "/v1/chat/completions",
                                               json={**CHAT, "messages": messages}, timeout=30), 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert rendered == []


def test_stop_strings_are_bounded(fake_server) -> None:
    srv = fake_server()
    error = assert_openai_error(httpx.post(srv.url + "/v1/completions", timeout=30,
                                           json={**PROMPT, "stop": ["x" * (MAX_STOP_CHARS + 1)]}), 400)
    assert error["param"] == "stop"
    ok = httpx.post(srv.url + "/v1/completions", json={**PROMPT, "stop": ["x" * MAX_STOP_CHARS]}, timeout=30)
    assert ok.status_code == 200


def test_a_non_ascii_api_key_is_compared_as_utf8(fake_server) -> None:
    key = "clé-ü"
    srv = fake_server(api_key=key)
    for header, status in ((("Bearer " + key).encode(), 200), (("Bearer " + key).encode("latin-1"), 401),
                           (b"Bearer wrong", 401)):
        assert httpx.get(srv.url + "/v1/models", headers=[(b"authorization", header)]).status_code == status
    assert httpx.get(srv.url + "/v1/models", headers=[(b"x-api-key", key.encode())]).status_code == 200


def test_infill_bodies_go_through_the_same_json_checks(fake_server) -> None:
    srv = fake_server()
    raw = json.dumps({"input_prefix": "x", "junk": [1] * (MAX_JSON_VALUES + 1)}).encode()
    assert assert_openai_error(post(srv.url, "/infill", raw), 400)["code"] == "too_many_json_values"
