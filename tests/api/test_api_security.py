"""What a web page cannot do to a key-less local server: POST a CORS-simple (text/plain) body, or
reach it through a rebound DNS name (Host check)."""

from __future__ import annotations

import httpx
import openai
import pytest

from server.config import ServerConfig
from server.security import allowed_hosts, host_name, is_loopback
from tests.api.test_api_app import CHAT, assert_openai_error

RAW = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/json; charset=latin-1", "application/jsonx"])
def test_post_bodies_must_be_json(fake_server, content_type: str | None) -> None:
    srv = fake_server()
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = httpx.post(srv.url + path, content=RAW, headers=headers, timeout=30)
        error = assert_openai_error(response, 415, "invalid_request_error")
        assert error["code"] == "unsupported_media_type" and response.headers["x-should-retry"] == "false"
    assert srv.engine.requests == []  # nothing was generated


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=\"UTF-8\""])
def test_json_bodies_and_the_sdk_work(fake_server, content_type: str) -> None:
    srv = fake_server()
    response = httpx.post(srv.url + "/v1/chat/completions", content=RAW, headers={"content-type": content_type},
                          timeout=30)
    assert response.status_code == 200, response.text
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="fake-model", messages=CHAT["messages"], max_tokens=4)
    assert out.choices[0].finish_reason == "length"


def test_api_key_is_checked_before_the_content_type(fake_server) -> None:
    srv = fake_server(api_key="sekrit")
    assert_openai_error(httpx.post(srv.url + "/v1/completions", content=b"x", headers={"content-type": "text/plain"}),
                        401)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "0.0.0.0:8000", "10.0.0.1"])
def test_rebound_host_names_are_refused(fake_server, host: str) -> None:
    srv = fake_server()
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        response = httpx.request(method, srv.url + path, json=CHAT, headers={"host": host}, timeout=30)
        error = assert_openai_error(response, 403)
        assert error["code"] == "host_not_allowed", (method, path)
    assert srv.engine.requests == []


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:9",
                                  "127.1.2.3:80", "[::1]", "[::1]:8000", "localhost."])
def test_loopback_host_names_are_served(fake_server, host: str) -> None:
    srv = fake_server()
    assert httpx.get(srv.url + "/health", headers={"host": host}).status_code == 200
    response = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"host": host}, timeout=30)
    assert response.status_code == 200, response.text


def test_allowed_hosts_extend_or_open_the_check(fake_server) -> None:
    srv = fake_server(allowed_hosts=("myhost.lan", "Box.Local"))
    for host in ("myhost.lan", "myhost.lan:8000", "box.local:1", "localhost:8000"):
        assert httpx.get(srv.url + "/health", headers={"host": host}).status_code == 200, host
    assert_openai_error(httpx.get(srv.url + "/health", headers={"host": "other.lan"}), 403)
    srv = fake_server(allowed_hosts=("*",))
    assert httpx.get(srv.url + "/health", headers={"host": "anything.example"}).status_code == 200


def test_a_non_loopback_bind_allows_any_host_unless_listed(fake_server) -> None:
    # uvicorn binds 127.0.0.1 in this fixture; the check reads the configured bind address
    srv = fake_server(host="0.0.0.0")
    assert httpx.get(srv.url + "/health", headers={"host": "gpu-box.lan:8000"}).status_code == 200
    srv = fake_server(host="0.0.0.0", allowed_hosts=("gpu-box.lan",))
    assert httpx.get(srv.url + "/health", headers={"host": "gpu-box.lan:8000"}).status_code == 200
    assert_openai_error(httpx.get(srv.url + "/health", headers={"host": "evil.example"}), 403)


def test_host_parsing() -> None:
    assert host_name("Example.COM:8000") == "example.com" and host_name("[::1]:80") == "::1"
    assert host_name("localhost.") == "localhost" and host_name("[::1") == "[::1"
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "localhost.example", ""))
    assert allowed_hosts(ServerConfig()) == frozenset()
    assert allowed_hosts(ServerConfig(host="::1")) == frozenset()
    assert allowed_hosts(ServerConfig(host="0.0.0.0")) is None
    assert allowed_hosts(ServerConfig(allowed_hosts=("*",))) is None
    assert allowed_hosts(ServerConfig(host="192.168.1.5", allowed_hosts=("A.lan",))) == {"a.lan"}
