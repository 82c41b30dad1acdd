"""Request validation: strict types, ranges, unsupported options, param names (no server)."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest, error_param, parse_request

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": MSGS, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{not json", None, None),
        (b"[1, 2]", None, None),
        (json.dumps({"model": "m"}).encode(), "messages", "missing_required_parameter"),
        (chat(messages=[]), "messages", "invalid_value"),
        (chat(messages="hi"), "messages", "invalid_value"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "invalid_value"),
        (chat(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_value"),
        (chat(temperature="hot"), "temperature", "invalid_value"),
        (chat(temperature=-0.5), "temperature", "invalid_value"),
        (chat(temperature=True), "temperature", "invalid_value"),
        (chat(top_p=1.5), "top_p", "invalid_value"),
        (chat(max_tokens=0), "max_tokens", "invalid_value"),
        (chat(max_tokens=2.5), "max_tokens", "invalid_value"),
        (chat(max_completion_tokens=-3), "max_completion_tokens", "invalid_value"),
        (chat(n=0), "n", "invalid_value"),
        (chat(n=9), "n", "invalid_value"),
        (chat(stop=[1, 2]), "stop", "invalid_value"),
        (chat(stop=[""]), "stop", None),
        (chat(presence_penalty=3), "presence_penalty", "invalid_value"),
        (chat(logit_bias={"5": "x"}), "logit_bias", "invalid_value"),
        (chat(stream="yes"), "stream", "invalid_value"),
        (chat(stream_options={"include_usage": True}), "stream_options", None),
        (chat(top_logprobs=2), "top_logprobs", None),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (chat(tool_choice="required"), "tool_choice", None),
        (chat(tools=[{"type": "custom", "function": {"name": "f"}}]), "tools[0].type", "invalid_value"),
        (chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0]",
         "unsupported_parameter"),
        (chat(seed="x"), "seed", "invalid_value"),
        (chat(top_k=-5), "top_k", "invalid_value"),
    ],
)
def test_chat_rejections(raw: bytes, param: str | None, code: str | None) -> None:
    with pytest.raises(APIError) as info:
        parse_request(raw, ChatCompletionRequest)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param
    assert err.code == code
    assert err.body()["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (json.dumps({"model": "m"}).encode(), "prompt"),
        (completion(prompt=""), "prompt"),
        (completion(prompt=["a", "b"]), "prompt"),
        (completion(prompt=[1, "a"]), "prompt"),
        (completion(echo=True), "echo"),
        (completion(best_of=3), "best_of"),
        (completion(logprobs=21), "logprobs"),
    ],
)
def test_completion_rejections(raw: bytes, param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_request(raw, CompletionRequest)
    assert info.value.status == 400 and info.value.param == param


def test_accepts_openai_and_extra_fields() -> None:
    req = parse_request(
        chat(temperature=0, top_p=0.9, seed=3, stop="x", n=1, user="u", metadata={"a": 1}, unknown_field=[1],
             stream=True, stream_options={"include_usage": True}, top_k=40, min_p=0.05, tool_choice="none",
             tools=[], response_format={"type": "text"}, logprobs=False,
             messages=[{"role": "system", "content": "s"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": None}]),
        ChatCompletionRequest,
    )
    assert isinstance(req, ChatCompletionRequest) and req.temperature == 0.0 and req.top_k == 40
    for prompt in ("x", [1, 2], ["x"], [[1, 2]]):
        assert parse_request(completion(prompt=prompt), CompletionRequest).prompt == prompt


def test_error_param_drops_union_tags() -> None:
    assert error_param(("messages", 0, "role")) == "messages[0].role"
    assert error_param(("stop", "list[str]", 0)) == "stop[0]"
    assert error_param(("temperature",)) == "temperature"


def test_to_sampling_params_maps_openai_fields_to_the_engine() -> None:
    req = parse_request(chat(temperature=0.5, top_p=0.0, top_k=-1, seed=-1, stop="x", max_completion_tokens=7,
                             max_tokens=99, logit_bias={"3": -100, "4": 2.5}, stop_token_ids=[5]),
                        ChatCompletionRequest)
    assert req.requested_max_tokens() == 7 and req.stop_strings() == ["x"]
    params = req.to_sampling_params(max_tokens=7, vocab_size=10)
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 1.0, 1)  # top_p 0: the most likely token
    assert params.seed == 2**63 - 1 and params.max_tokens == 7
    assert params.logit_bias == {3: -100.0, 4: 2.5} and params.stop_token_ids == (5,)
    defaults = parse_request(completion(), CompletionRequest).to_sampling_params(max_tokens=16, vocab_size=10)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.seed) == (1.0, 1.0, 0, None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"10": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_to_sampling_params_checks_token_ids_against_the_vocab(fields: dict, param: str) -> None:
    req = parse_request(chat(**fields), ChatCompletionRequest)
    with pytest.raises(APIError) as info:
        req.to_sampling_params(max_tokens=4, vocab_size=10)
    assert info.value.status == 400 and info.value.param == param
