"""Malformed JSON that once gave 500s: nesting ~1000 deep, lone surrogates in strings. Now 400s
naming the field."""

from __future__ import annotations

import httpx
import pytest

from server.errors import APIError
from server.json_body import MAX_JSON_DEPTH, load_json_object
from tests.api.test_api_app import assert_openai_error

JSON = {"content-type": "application/json"}
MSG = '[{"role": "user", "content": "hi"}]'


def post(url: str, path: str, raw: str) -> httpx.Response:
    return httpx.post(url + path, content=raw.encode(), headers=JSON, timeout=30)


@pytest.mark.parametrize("depth", [1000, 5000, 100_000])
def test_deep_nesting_is_400(fake_server, depth: int) -> None:
    srv = fake_server()
    for raw in (f'{{"messages": {MSG}, "x": {"[" * depth}{"]" * depth}}}', "[" * depth + "]" * depth,
                f'{{"messages": {MSG}, "tools": {"[" * depth}'):
        error = assert_openai_error(post(srv.url, "/v1/chat/completions", raw), 400, "invalid_request_error")
        assert "nested" in error["message"] or "parse" in error["message"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_nesting_past_the_bound_names_the_field(fake_server) -> None:
    srv = fake_server()
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    raw = f'{{"messages": {MSG}, "tools": [{{"type": "function", "function": {{"parameters": {deep}}}}}]}}'
    error = assert_openai_error(post(srv.url, "/v1/chat/completions", raw), 400)
    assert error["param"].startswith("tools[0].function.parameters") and "nested" in error["message"]


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
        ("/v1/completions", '{"prompt": "a\\udc00b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["\\ud83d"]}', "prompt[0]"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["x", "\\udfff"]}', "stop[1]"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok \\ud800"}]}]}',
         "messages[0].content[0].text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\udbff"}]}',
         "messages[0].name"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}', "user"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(fake_server, path: str, raw: str, param: str) -> None:
    srv = fake_server()
    response = post(srv.url, path, raw)
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param and "surrogate" in error["message"], error
    assert response.headers["x-should-retry"] == "false"


def test_paired_surrogates_are_text(fake_server) -> None:
    srv = fake_server()
    response = post(srv.url, "/v1/completions", '{"prompt": "smile \\ud83d\\ude42", "max_tokens": 3}')
    assert response.status_code == 200, response.text


def test_load_json_object_unit() -> None:
    assert load_json_object(b'{"a": [1, {"b": "\xc3\xa9"}]}') == {"a": [1, {"b": "é"}]}
    for raw, param in ((b'{"a": {"\\ud800": 1}}', "a.\\ud800"), (b'{"a": [0, ["\\udc00"]]}', "a[1][0]")):
        with pytest.raises(APIError) as info:
            load_json_object(raw)
        assert info.value.status == 400 and info.value.param == param
        info.value.response()  # the error itself encodes as UTF-8
    nested = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert load_json_object(nested)["a"]  # MAX_JSON_DEPTH levels, the top object included: allowed
