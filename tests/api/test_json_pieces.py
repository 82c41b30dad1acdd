"""Large bodies off the event loop and in pieces (server/json_pieces.py, the preparation lanes): parsing,
validation and writing give what one call of json / pydantic gives, made of many short calls (between
which the interpreter lock changes hands), in the server's threads, not the event loop's."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import httpx
import pytest

import server.json_pieces as json_pieces
from server.errors import APIError
from server.json_body import PIECES_BYTES, load_json_object
from server.json_pieces import PIECE_ITEMS, VALIDATE_ITEMS, dumps_in_pieces, loads_in_pieces
from server.protocol import ChatCompletionRequest, SamplingRequest, parse_request
from tests.helpers.fake_engine import FakeEngine


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randint(0, 6 if depth < 4 else 2)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -1, 17, 3.25, -0.5e-7, 1e21, 10**30])
    if kind == 2:
        return "".join(rng.choice('ab "\\/\n\t\u00e9✓\x01日🙂') for _ in range(rng.randint(0, 6)))
    if kind in (3, 4):
        return {rng.choice(["k", "é\"", "x"]) + str(i): random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    wide = depth < 2 and rng.random() < 0.2  # longer than PIECE_ITEMS
    return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 80 if wide else 4))]


def test_loads_and_dumps_in_pieces_equal_one_call() -> None:
    rng = random.Random(0)
    for _ in range(400):
        value = {"a": random_value(rng), "b": [random_value(rng, 2) for _ in range(rng.randint(0, 100))]}
        for text in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, separators=(",", ":"))):
            assert loads_in_pieces(text.encode()) == json.loads(text)
        assert dumps_in_pieces(value) == json.dumps(value, ensure_ascii=False, allow_nan=False,
                                                    separators=(",", ":")).encode()
    for bad in ['{', '{"a":}', '{"a":1,}', '[1,]', '{"a":1 "b":2}', '{"a":1}x', '', '{"a":[1 2]}', '{"a":"\x01"}',
                '{a:1}', '{"a":[1,2', '{"a":' + "9" * 5000 + "}"]:
        with pytest.raises(ValueError):
            json.loads(bad)
        with pytest.raises(ValueError):
            loads_in_pieces(bad.encode())


def big_chat(num_messages: int, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(num_messages)]
    return {"messages": messages, **fields}


def test_a_large_body_is_parsed_one_value_per_call(monkeypatch) -> None:
    calls = []
    scan = json_pieces._scan_once

    def counting(text: str, index: int) -> tuple[Any, int]:
        calls.append(index)
        return scan(text, index)

    monkeypatch.setattr(json_pieces, "_scan_once", counting)
    body = big_chat(5000, logit_bias={str(i): 1.0 for i in range(3000)})
    raw = json.dumps(body).encode()
    assert len(raw) > PIECES_BYTES and load_json_object(raw) == body
    assert len(calls) >= 5000 + 3000  # a message or a bias per call
    calls.clear()
    assert load_json_object(b'{"messages": []}') == {"messages": []} and not calls  # small bodies: json.loads


def test_long_fields_are_validated_in_pieces_with_the_same_result_and_errors(monkeypatch) -> None:
    body = big_chat(3000, logit_bias={str(i): 1 for i in range(2000)}, stop_token_ids=list(range(1000)),
                    temperature=0.5)
    sizes: list[int] = []
    real = json_pieces._validate_pieces

    def recording(name: str, value: Any, adapter: Any) -> Any:
        sizes.append(len(value))
        return real(name, value, adapter)

    monkeypatch.setattr(json_pieces, "_validate_pieces", recording)
    request = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert sorted(sizes) == [1000, 2000, 3000] and max(sizes) > VALIDATE_ITEMS
    assert request == ChatCompletionRequest.model_validate(body)
    assert request.model_fields_set == ChatCompletionRequest.model_validate(body).model_fields_set
    for bad, param in [(big_chat(3000, temperature="hot"), "temperature"),
                       ({**body, "messages": body["messages"][:1500] + [{"role": "x"}]}, "messages[1500].role"),
                       ({**body, "stop_token_ids": [*range(1000), "a"]}, "stop_token_ids[1000]"),
                       ({**body, "logit_bias": {**body["logit_bias"], "7": "a"}}, "logit_bias")]:
        with pytest.raises(APIError) as info:
            parse_request(json.dumps(bad).encode(), ChatCompletionRequest)
        assert info.value.status == 400 and info.value.param == param


def test_a_whole_response_is_built_and_written_off_the_event_loop(fake_server, monkeypatch) -> None:
    """n=8, top_logprobs=20: the body is built in the render lane's threads, written a few entries per
    call; the sampling parameters (a large logit_bias) are made in a preparation lane."""
    threads: dict[str, set[str]] = {"render": set(), "params": set()}
    writes: list[int] = []
    dumps, to_params = json_pieces._dumps, SamplingRequest.to_sampling_params

    def recording_dumps(value: Any) -> str:
        threads["render"].add(threading.current_thread().name)
        writes.append(len(value) if isinstance(value, list) else 1)
        return dumps(value)

    def recording_params(self: SamplingRequest, *args: Any) -> Any:
        threads["params"].add(threading.current_thread().name)
        return to_params(self, *args)

    monkeypatch.setattr(json_pieces, "_dumps", recording_dumps)
    monkeypatch.setattr(SamplingRequest, "to_sampling_params", recording_params)
    srv = fake_server(FakeEngine(max_context=4096), max_queue=16)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True,
            "top_logprobs": 20, "max_tokens": 300, "logit_bias": {str(i): 1 for i in range(200)}}
    reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 8
    assert reply.json() == json.loads(reply.content)
    assert threads["render"] and all(name.startswith("specexec-render") for name in threads["render"])
    assert threads["params"] and all(name.startswith("specexec-prepare") for name in threads["params"])
    assert max(writes) <= PIECE_ITEMS and len(writes) > 8 * 300 // PIECE_ITEMS


def test_prompts_encode_as_the_tokenizer_does_and_one_over_the_context_never_becomes_a_list(monkeypatch) -> None:
    """The fast tokenizer's Rust side is called directly (it lets go of the lock while it encodes): the
    same ids as `tokenizer.encode`; a prompt longer than the context is refused from its length alone."""
    from transformers import PreTrainedTokenizerFast

    from server.prompt import PromptBuilder
    from tests.api.test_fim import codellama_tokenizer, qwen_tokenizer
    from tests.helpers.fake_engine import tiny_tokenizer

    rng = random.Random(1)
    pieces = ["a", " ", "hello", "日本", "\n", "<|im_start|>", "<s>", "🙂", "  x", "<|fim_prefix|>"]
    for tokenizer in (tiny_tokenizer(), qwen_tokenizer(), codellama_tokenizer()):
        prompt = PromptBuilder(tokenizer, max_context=10**6, default_max_tokens=8, validate=lambda *_: None)
        for _ in range(100):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
            for special in (True, False):
                assert prompt.encode(text, special, "prompt") == list(tokenizer.encode(text, add_special_tokens=special))
    made_lists: list[int] = []
    real = PreTrainedTokenizerFast.backend_tokenizer

    class Encoding:
        def __init__(self, encoding: Any):
            self._encoding = encoding

        def __len__(self) -> int:
            return len(self._encoding)

        @property
        def ids(self) -> list[int]:
            made_lists.append(len(self._encoding))
            return self._encoding.ids

    class Backend:
        def __init__(self, backend: Any):
            self._backend, self.truncation, self.padding = backend, backend.truncation, backend.padding

        def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[Encoding]:
            return [Encoding(e) for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    tokenizer = tiny_tokenizer()
    prompt = PromptBuilder(tokenizer, max_context=64, default_max_tokens=8, validate=lambda *_: None)
    monkeypatch.setattr(PreTrainedTokenizerFast, "backend_tokenizer", property(lambda self: Backend(real.fget(self))))
    hello = len(tokenizer.encode("hello", add_special_tokens=False))
    assert prompt.encode("hello", False, "prompt") and made_lists == [hello]
    with pytest.raises(APIError) as info:
        prompt.encode("hello world " * 20, True, "prompt")
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt" and made_lists == [hello]
