"""POST /tokenize and /detokenize in llama.cpp's and vLLM's dialects, over the fake engine's tokenizers;
the reference is the transformers tokenizer called directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.api.test_api_app import assert_openai_error
from tests.api.test_fim import codellama_tokenizer
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import openai_client, scripted_engine

TEXT = "Hello, world! Ünïcödé ✓ 日本語 🙂 def add(a, b):\n    return a + b\n"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi 🙂 in 日本語."}]


def post(srv: Any, path: str, body: object, **kwargs: Any) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30, **kwargs)


def joined(pieces: list[str | list[int]]) -> str:
    return b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces).decode()


def test_llama_cpp_round_trip_equals_the_tokenizer(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    tokenizer = srv.engine.tokenizer
    r = post(srv, "/tokenize", {"content": TEXT})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": tokenizer.encode(TEXT, add_special_tokens=False)}
    back = post(srv, "/detokenize", {"tokens": r.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"content": TEXT, "prompt": TEXT}
    assert post(srv, "/detokenize", {"tokens": []}).json() == {"content": "", "prompt": ""}


def test_add_special_adds_bos_as_the_tokenizer_does(fake_server: Callable) -> None:
    """A SentencePiece-style tokenizer that adds <s> on encode: llama.cpp's add_special (default false),
    vLLM's add_special_tokens (default true for text)."""
    tokenizer = codellama_tokenizer()
    srv = fake_server(scripted_engine(tokenizer, "x"))
    text = "def add(a, b): return a + b"
    with_bos, without = (tokenizer.encode(text, add_special_tokens=add) for add in (True, False))
    assert with_bos == [tokenizer.bos_token_id, *without]
    assert post(srv, "/tokenize", {"content": text}).json()["tokens"] == without
    assert post(srv, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == with_bos
    assert post(srv, "/tokenize", {"prompt": text}).json()["tokens"] == with_bos
    assert post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == without
    assert post(srv, "/detokenize", {"tokens": without}).json()["content"] == text
    assert post(srv, "/detokenize", {"tokens": with_bos}).json()["content"] == tokenizer.decode(with_bos)


def test_with_pieces_join_to_the_text(fake_server: Callable) -> None:
    """Byte-level BPE: a token holding part of a character is given as its bytes, as llama.cpp gives it;
    SentencePiece: each piece keeps the space its token stands for."""
    srv = fake_server(FakeEngine())
    tokens = post(srv, "/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in tokens] == srv.engine.tokenizer.encode(TEXT, add_special_tokens=False)
    assert joined([t["piece"] for t in tokens]) == TEXT
    assert {"id": tokens[0]["id"], "piece": "Hel"} == tokens[0]
    assert [240] in [t["piece"] for t in tokens]  # the emoji's first byte, a token of its own
    sp = fake_server(scripted_engine(codellama_tokenizer(), "x"))
    text = "Hello world  x = 1"
    pieces = [t["piece"] for t in post(sp, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]]
    assert joined(pieces) == text and all(isinstance(p, str) for p in pieces)
    assert any(p.startswith(" ") for p in pieces)  # a token decoded alone would lose its space
    bos = post(sp, "/tokenize", {"content": text, "with_pieces": True, "add_special": True}).json()["tokens"]
    assert bos[0]["piece"] == "<s>" and joined([t["piece"] for t in bos]) == "<s> " + text


def test_parse_special_false_reads_special_tokens_as_text(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    tokenizer = srv.engine.tokenizer
    text = "Hi<|end|>there"
    parsed = post(srv, "/tokenize", {"content": text}).json()["tokens"]
    assert tokenizer.eos_token_id in parsed and parsed == tokenizer.encode(text, add_special_tokens=False)
    plain = post(srv, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"]
    assert tokenizer.eos_token_id not in plain and len(plain) > len(parsed)
    assert post(srv, "/detokenize", {"tokens": plain}).json()["content"] == text
    assert post(srv, "/tokenize", {"content": text}).json()["tokens"] == parsed  # the shared tokenizer unchanged


def test_vllm_text_shape_and_token_strs(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine(max_context=256))
    tokenizer = srv.engine.tokenizer
    ids = tokenizer.encode(TEXT)
    assert post(srv, "/tokenize", {"model": "fake-model", "prompt": TEXT}).json() == {
        "count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    out = post(srv, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(ids)


def test_messages_count_equals_chat_prompt_tokens(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    client = openai_client(srv)
    chat = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1)
    out = post(srv, "/tokenize", {"model": "fake-model", "messages": MESSAGES}).json()
    assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
    assert out["tokens"] == srv.engine.requests[-1].prompt_ids


def test_messages_template_options(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    tokenizer = srv.engine.tokenizer

    def expected(messages: list[dict[str, str]], **options: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return tokenizer.encode(text, add_special_tokens=False)

    tokens = post(srv, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert tokens == expected(MESSAGES, add_generation_prompt=False)
    assert post(srv, "/tokenize", {"messages": MESSAGES}).json()["tokens"] == expected(MESSAGES,
                                                                                      add_generation_prompt=True)
    prefill = [*MESSAGES, {"role": "assistant", "content": "こんにちは"}]
    tokens = post(srv, "/tokenize", {"messages": prefill, "continue_final_message": True}).json()["tokens"]
    assert tokens == expected(prefill, continue_final_message=True)
    assert tokenizer.decode(tokens).endswith("<|assistant|>\nこんにちは")


def test_a_count_beyond_the_context_is_given(fake_server: Callable) -> None:
    """Only text longer in characters than any context could hold is refused."""
    srv = fake_server(FakeEngine(max_context=64))
    out = post(srv, "/tokenize", {"prompt": TEXT * 4}).json()
    assert out["count"] > out["max_model_len"] == 64
    too_long = "x" * (srv.state.prompt.max_prompt_chars + 1)
    for body in ({"prompt": too_long}, {"content": too_long}, {"messages": [{"role": "user", "content": too_long}]}):
        error = assert_openai_error(post(srv, "/tokenize", body), 400, "invalid_request_error")
        assert error["code"] == "context_length_exceeded" and error["param"] == next(iter(body))


TOKENIZE_ERRORS = [
    ({}, 400, "prompt"),
    ({"content": None}, 400, "prompt"),
    ({"content": "a", "prompt": "b"}, 400, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
    ({"content": 5}, 400, "content"),
    ({"content": "a", "add_special": "yes"}, 400, "add_special"),
    ({"content": "a", "with_pieces": 1}, 400, "with_pieces"),
    ({"prompt": ["a"]}, 400, "prompt"),
    ({"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ({"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "a"}], "model": "gpt-4o"}, 404, "model"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages[0].role"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True, "add_generation_prompt": True},
     400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
]
DETOKENIZE_ERRORS = [
    ({}, 400, "tokens"),
    ({"tokens": "1 2"}, 400, "tokens"),
    ({"tokens": [1, 2.5]}, 400, "tokens[1]"),
    ({"tokens": [True]}, 400, "tokens[0]"),
    ({"tokens": [1, -1]}, 400, "tokens"),
    ({"tokens": [1, 320]}, 400, "tokens"),  # the fake tokenizer has 320 ids
    ({"tokens": [1], "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [("/tokenize", *case) for case in TOKENIZE_ERRORS]
                         + [("/detokenize", *case) for case in DETOKENIZE_ERRORS])
def test_bad_input_is_an_openai_error_naming_the_field(fake_server: Callable, path: str, body: dict, status: int,
                                                       param: str) -> None:
    srv = fake_server(FakeEngine())
    error = assert_openai_error(post(srv, path, body), status, "invalid_request_error")
    assert error["param"] == param, error
    if status == 404:
        assert error["code"] == "model_not_found"
    assert post(srv, "/tokenize", {"content": "ok"}).status_code == 200  # the next request is answered
    assert post(srv, "/detokenize", {"tokens": [1]}).status_code == 200


def test_bodies_go_through_the_json_checks(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    for path in ("/tokenize", "/detokenize"):
        raw = httpx.post(srv.url + path, content=b'{"content": "x",', headers={"content-type": "application/json"},
                         timeout=30)
        assert "parse the JSON" in assert_openai_error(raw, 400)["message"]
        lone = httpx.post(srv.url + path, content=b'{"content": "\\ud800", "tokens": [1]}',
                          headers={"content-type": "application/json"}, timeout=30)
        if path == "/tokenize":
            assert assert_openai_error(lone, 400)["param"] == "content"
        assert assert_openai_error(httpx.post(srv.url + path, content=b"x", timeout=30), 415)["param"] == "content-type"
    assert post(srv, "/tokenize", {"content": "x", "model": "anything"}).status_code == 200  # llama.cpp ignores it


def test_api_key_is_required_like_v1(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine(), api_key="sekrit")
    for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})):
        error = assert_openai_error(post(srv, path, body), 401, "authentication_error")
        assert error["code"] == "invalid_api_key"
        assert_openai_error(post(srv, path, body, headers={"authorization": "Bearer wrong"}), 401)
        assert post(srv, path, body, headers={"authorization": "Bearer sekrit"}).status_code == 200
        assert post(srv, path, body, headers={"x-api-key": "sekrit"}).status_code == 200
