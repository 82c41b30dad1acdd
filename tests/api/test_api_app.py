"""The HTTP layer over a FakeEngine (uvicorn in a thread): wire format, pings, faults, loading."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from engine.types import EngineFault
from tests.helpers.fake_engine import SCRIPT, FakeEngine
from tests.helpers.polling import wait_until
from tests.helpers.sse_helpers import assert_stream_invariants, post_stream

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
PROMPT = {"model": "fake-model", "prompt": "hi", "max_tokens": 40}


def assert_openai_error(response: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if type_ is not None:
        assert body["error"]["type"] == type_
    return body["error"]


def test_stream_wire_format_and_text_equals_non_stream(fake_server) -> None:
    srv = fake_server()
    for path, body, chat in (("/v1/chat/completions", CHAT, True), ("/v1/completions", PROMPT, False)):
        plain = httpx.post(srv.url + path, json=body, timeout=30).json()
        text = plain["choices"][0]["message"]["content"] if chat else plain["choices"][0]["text"]
        for include_usage in (False, True):
            stream_body = {**body, "stream": True}
            if include_usage:
                stream_body["stream_options"] = {"include_usage": True}
            stream = post_stream(srv.url + path, stream_body)
            assert assert_stream_invariants(stream, chat, include_usage) == text
            assert "\ufffd" not in stream.text  # never half a UTF-8 character
        assert text == srv.engine.tokenizer.decode(srv.engine.script_ids)[: len(text)]
        assert plain["usage"]["completion_tokens"] == 40 and plain["choices"][0]["finish_reason"] == "length"
        assert plain["timings"]["target_passes"] == 14


def test_stop_string_over_token_boundaries(fake_server) -> None:
    srv = fake_server()
    body = {**CHAT, "stop": ["brown fox", "zzz"], "max_tokens": 100}
    plain = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()
    content = plain["choices"][0]["message"]["content"]
    assert content == SCRIPT[: SCRIPT.index("brown fox")]
    assert plain["choices"][0]["finish_reason"] == "stop"
    stream = post_stream(srv.url + "/v1/chat/completions", {**body, "stream": True})
    assert assert_stream_invariants(stream, True, False) == content


def test_sampling_fields_reach_the_engine(fake_server) -> None:
    srv = fake_server()
    body = {**PROMPT, "temperature": 0.7, "top_p": 0, "seed": -1, "logit_bias": {"7": -100}, "min_p": 0.1,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stop_token_ids": [9],
            "ignore_eos": True, "max_tokens": 5}
    assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
    params = srv.engine.requests[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 1.0, 1, 0.1)
    assert params.logit_bias == {7: -100.0} and params.seed == 2**63 - 1 and params.max_tokens == 5
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert params.stop_token_ids == (9,) and params.ignore_eos


def test_pings_during_long_passes_and_sdk_ignores_them(fake_server) -> None:
    srv = fake_server(FakeEngine(step_seconds=0.5, tokens_per_step=4), ping_seconds=0.2)
    stream = post_stream(srv.url + "/v1/chat/completions", {**CHAT, "max_tokens": 8, "stream": True})
    assert "ping" in stream.comments and ": ping\n\n" in stream.text
    assert_stream_invariants(stream, True, False)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="fake-model", messages=CHAT["messages"], max_tokens=8,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_health_is_503_while_loading(fake_server) -> None:
    release = threading.Event()

    def slow_loader(config):
        assert release.wait(30)
        return FakeEngine()

    srv = fake_server(loader=slow_loader)
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    error = assert_openai_error(httpx.post(srv.url + "/v1/chat/completions", json=CHAT), 503)
    assert error["code"] == "model_loading"
    assert_openai_error(httpx.get(srv.url + "/v1/models"), 503)
    release.set()
    wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, "health 200 after loading")
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "fake-model"


def test_load_failure_keeps_health_failing(fake_server) -> None:
    def broken_loader(config):
        raise FileNotFoundError("no such checkpoint")

    srv = fake_server(loader=broken_loader)
    wait_until(lambda: srv.state.load_error is not None, "the load error")
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and "no such checkpoint" in health.json()["error"]


def test_request_failure_is_isolated(fake_server) -> None:
    engine = FakeEngine(fail_with=RuntimeError("kaboom"))
    srv = fake_server(engine)
    response = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
    error = assert_openai_error(response, 500, "server_error")
    assert "kaboom" in error["message"] and response.headers["x-should-retry"] == "false"
    stream = post_stream(srv.url + "/v1/chat/completions", {**CHAT, "stream": True})
    assert stream.status == 200 and stream.data[-1] == "[DONE]"
    assert "kaboom" in stream.chunks()[-1]["error"]["message"]
    engine.fail_with = None
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_device_fault_fails_health(fake_server) -> None:
    srv = fake_server(FakeEngine(fail_with=EngineFault("device lost")))
    assert_openai_error(httpx.post(srv.url + "/v1/completions", json=PROMPT, timeout=30), 503)
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and "device lost" in health.json()["error"]
    response = httpx.post(srv.url + "/v1/completions", json=PROMPT, timeout=30)
    assert_openai_error(response, 503)
    assert response.headers["x-should-retry"] == "false"


def test_context_overflow_is_http_400_even_when_streaming(fake_server) -> None:
    srv = fake_server(FakeEngine(max_context=64))
    body = {**PROMPT, "prompt": "word " * 100, "stream": True, "max_tokens": 10}
    response = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "maximum context length is 64 tokens" in error["message"]
    exact = {**PROMPT, "prompt": list(range(3, 67)), "max_tokens": 1}  # 64 prompt tokens: no room left
    error = assert_openai_error(httpx.post(srv.url + "/v1/completions", json=exact), 400)
    assert error["code"] == "context_length_exceeded" and "the prompt alone has 64 tokens" in error["message"]


def test_max_tokens_beyond_the_context_is_cut_to_what_fits(fake_server) -> None:
    """Continue sends max_tokens 4096, Open WebUI's title request 1000: the budget is what the context
    leaves, and the reply ends with finish_reason "length" when it is used up."""
    srv = fake_server(FakeEngine(max_context=64, tokens_per_step=7))
    body = {**PROMPT, "prompt": list(range(3, 53)), "max_tokens": 4096, "ignore_eos": True}
    response = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] == 50 and usage["completion_tokens"] == 14 and usage["total_tokens"] == 64
    assert srv.engine.requests[-1].params.max_tokens == 14
    chat = {**CHAT, "max_completion_tokens": 100_000, "ignore_eos": True}
    assert httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200


def test_chat_template_override(fake_server, tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>>")
    srv = fake_server(chat_template=str(template))
    body = {**CHAT, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    usage = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()["usage"]
    prompt_ids = srv.engine.requests[-1].prompt_ids
    assert srv.engine.tokenizer.decode(prompt_ids) == "[system]be brief[user]hi>>"
    assert usage["prompt_tokens"] == len(prompt_ids)


def test_unknown_routes_and_methods_are_openai_shaped(fake_server) -> None:
    srv = fake_server()
    assert_openai_error(httpx.get(srv.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(srv.url + "/v1/chat/completions"), 405)
    error = assert_openai_error(httpx.get(srv.url + "/v1/models/other"), 404)
    assert error["code"] == "model_not_found"


def test_non_stream_disconnect_aborts(fake_server) -> None:
    srv = fake_server(FakeEngine(step_seconds=0.05, max_context=100_000))
    body = {**PROMPT, "max_tokens": 6000, "ignore_eos": True}  # 2,000 steps: 100 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: b"specexec_aborted_requests_total 1.0" in httpx.get(srv.url + "/metrics").content,
               "the abort")
    metrics = httpx.get(srv.url + "/metrics").text
    assert "specexec_aborted_requests_total 1.0" in metrics and "specexec_requests_running 0.0" in metrics
    assert srv.engine.steps_run < 1000  # given up long before its end


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
def test_api_key_and_cors(fake_server, header: str) -> None:
    srv = fake_server(api_key="sekrit", cors_origins=("http://ui.example",))
    value = "Bearer sekrit" if header == "authorization" else "sekrit"
    assert httpx.get(srv.url + "/v1/models", headers={header: value}).status_code == 200
    error = assert_openai_error(httpx.get(srv.url + "/v1/models", headers={header: value + "x"}), 401)
    assert error["type"] == "authentication_error"
    assert_openai_error(httpx.post(srv.url + "/v1/chat/completions", content=b"{bad"), 401)
    assert httpx.get(srv.url + "/health").status_code == 200
    preflight = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.options(srv.url + "/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers


def test_root_answers_200_to_head_and_get_even_while_loading(fake_server) -> None:
    """Claude Code probes `HEAD /` before anything else; a 404 there ended its session."""
    release = threading.Event()

    def slow_loader(config):
        assert release.wait(30)
        return FakeEngine()

    srv = fake_server(loader=slow_loader, api_key="sekrit")
    head = httpx.head(srv.url + "/")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(srv.url + "/").status_code == 200
    release.set()
    assert httpx.head(srv.url + "/").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_timings_after_a_stop_string_count_only_the_returned_tokens(fake_server, stream: bool) -> None:
    """A stop string ends the text inside a step (3 tokens, 2 of them accepted draft tokens); the rest of
    that step and the step drained after the abort are not this reply's: every counter is over the
    returned tokens, and they agree with each other."""
    srv = fake_server(FakeEngine(tokens_per_step=3))
    body = {**CHAT, "stop": ["brown fox"], "max_tokens": 100, "stream": stream}
    if stream:
        chunks = post_stream(srv.url + "/v1/chat/completions", body).chunks()
        timings = next(c["timings"] for c in chunks if "timings" in c)
    else:
        timings = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()["timings"]
    returned = timings["predicted_n"]
    tokens = srv.engine.tokenizer.encode(SCRIPT[: SCRIPT.index("brown fox") + len("brown fox")],
                                         add_special_tokens=False)
    assert returned == len(tokens) and returned % 3 != 0  # the stop's last token is inside a step
    passes = -(-returned // 3)
    accepted = 2 * (passes - 1) + min(2, returned - 3 * (passes - 1))
    assert timings["target_passes"] == passes and timings["draft_tokens_accepted"] == accepted
    assert timings["mean_accepted_per_pass"] == round(returned / passes, 4)
    assert timings["mean_draft_accepted_per_pass"] == round(accepted / passes, 4)


def test_objects_alive_after_loading_are_frozen_out_of_the_collectors_view(fake_server, monkeypatch) -> None:
    """A full garbage collection walks every object it tracks while holding the interpreter lock: the
    loaded engine's are frozen (gc.freeze) once it is attached."""
    import gc

    frozen: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    srv = fake_server(loader=lambda config: FakeEngine())
    wait_until(lambda: srv.state.ready, "the engine attached")
    wait_until(lambda: frozen == [True], "gc.freeze after loading")
