"""Live server: the bad-input matrix, client disconnect, /health and /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.polling import wait_until

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def bad_inputs(model: str) -> list[tuple[str, str, object, int, str | None]]:
    """(method, path, body (dict, or raw bytes), expected status, expected param or code)."""
    chat = {"model": model, "messages": MSGS}
    comp = {"model": model, "prompt": "hi"}
    return [
        ("POST", CHAT, b"{not json", 400, None),
        ("POST", CHAT, b"", 400, None),
        ("POST", CHAT, b"[1, 2, 3]", 400, None),
        ("POST", CHAT, {"model": model}, 400, "messages"),
        ("POST", CHAT, {**chat, "messages": []}, 400, "messages"),
        ("POST", CHAT, {**chat, "messages": "hello"}, 400, "messages"),
        ("POST", CHAT, {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("POST", CHAT, {**chat, "messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content"),
        ("POST", CHAT, {**chat, "temperature": "warm"}, 400, "temperature"),
        ("POST", CHAT, {**chat, "temperature": -1}, 400, "temperature"),
        ("POST", CHAT, {**chat, "temperature": 9}, 400, "temperature"),
        ("POST", CHAT, {**chat, "top_p": 1.5}, 400, "top_p"),
        ("POST", CHAT, {**chat, "max_tokens": 0}, 400, "max_tokens"),
        ("POST", CHAT, {**chat, "max_tokens": "ten"}, 400, "max_tokens"),
        ("POST", CHAT, {**chat, "n": 9}, 400, "n"),
        ("POST", CHAT, {**chat, "stop": [1, 2]}, 400, "stop"),
        ("POST", CHAT, {**chat, "presence_penalty": 7}, 400, "presence_penalty"),
        ("POST", CHAT, {**chat, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("POST", CHAT, {**chat, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ("POST", CHAT, {**chat, "stream": "yes"}, 400, "stream"),
        ("POST", CHAT, {**chat, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("POST", CHAT, {**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("POST", CHAT, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": "required"}, 400, "tool_choice"),  # the tiny template renders no tools
        ("POST", CHAT, {**chat, "seed": "abc"}, 400, "seed"),
        ("POST", CHAT, {**chat, "model": "no-such-model"}, 404, "model_not_found"),
        ("POST", CHAT, {**chat, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
         "context_length_exceeded"),
        ("POST", COMP, {**comp, "prompt": list(range(3, 300)) * 2, "max_tokens": 1, "stream": True}, 400,
         "context_length_exceeded"),  # the prompt alone is over the context
        ("POST", COMP, {"model": model}, 400, "prompt"),
        ("POST", COMP, {**comp, "prompt": [1, 999999]}, 400, "prompt"),
        ("POST", COMP, {**comp, "prompt": ["a", "b"]}, 400, "prompt"),
        ("POST", COMP, {**comp, "prompt": ""}, 400, "prompt"),
        ("POST", COMP, {**comp, "echo": True}, 400, "echo"),
        ("POST", COMP, {**comp, "suffix": "}"}, 400, "suffix"),
        ("POST", COMP, {**comp, "best_of": 2}, 400, "best_of"),
        ("GET", "/v1/models/no-such-model", None, 404, "model_not_found"),
        ("GET", "/v1/no-such-route", None, 404, None),
        ("GET", CHAT, None, 405, None),
    ]


def test_bad_input_matrix(live_server, model_id: str) -> None:
    cases = bad_inputs(model_id)
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        for method, path, body, status, expected in cases:
            json_type = {"content-type": "application/json"}  # raw bytes: JSON that does not parse
            kwargs = {"content": body, "headers": json_type} if isinstance(body, bytes) else {"json": body}
            response = http.request(method, path, **({} if body is None else kwargs))
            label = f"{method} {path} {body!r:.80}"
            assert response.status_code == status, f"{label}: {response.status_code} {response.text}"
            payload = response.json()
            assert "detail" not in payload and set(payload) == {"error"}, label
            error = payload["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], label
            assert error["type"] == "invalid_request_error", label
            assert response.headers["x-should-retry"] == "false", label
            if expected is not None:
                assert expected in (error["param"], error["code"]), f"{label}: {error}"
            if error["code"] == "context_length_exceeded":
                assert re.search(r"maximum context length is \d+ tokens", error["message"])
        assert http.get("/health").json() == {"status": "ok"}
        ok = http.post(CHAT, json={"model": model_id, "messages": MSGS, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_disconnect_frees_the_request_within_one_step(live_server, client: openai.OpenAI, model_id: str) -> None:
    url = live_server.url
    before = httpx.get(f"{url}/metrics").text
    body = {"model": model_id, "messages": MSGS, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events == 3:  # the role chunk and 2 content chunks
                break
    # the connection is closed here; the engine must let go of the request
    aborted_before = metric(before, "specexec_aborted_requests_total")
    wait_until(lambda: metric(httpx.get(f"{url}/metrics").text, "specexec_aborted_requests_total") > aborted_before,
               "the abort")
    after = httpx.get(f"{url}/metrics").text
    assert metric(after, "specexec_requests_running") == 0.0
    assert metric(after, "specexec_queue_depth") == 0.0
    aborts = metric(after, "specexec_abort_lag_steps_count") - metric(before, "specexec_abort_lag_steps_count")
    within_one = (metric(after, "specexec_abort_lag_steps_bucket", '{le="1.0"}')
                  - metric(before, "specexec_abort_lag_steps_bucket", '{le="1.0"}'))
    assert aborts == 1 and within_one == 1
    chat_aborts = '{endpoint="chat",finish_reason="abort"}'
    assert metric(after, "specexec_requests_total", chat_aborts) == metric(before, "specexec_requests_total",
                                                                            chat_aborts) + 1
    passes = metric(after, "specexec_target_passes_total") - metric(before, "specexec_target_passes_total")
    assert passes < 300  # far fewer than the 400 tokens asked for
    out = client.chat.completions.create(model=model_id, messages=MSGS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_health_models_and_metrics(live_server, model_id: str) -> None:
    assert httpx.get(f"{live_server.url}/health").json() == {"status": "ok"}
    assert all(s in (200, 503) for s in live_server.health_statuses)
    models = httpx.get(f"{live_server.url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model_id]
    card = httpx.get(f"{live_server.url}/v1/models/{model_id}").json()
    assert card["id"] == model_id and card["object"] == "model"
    served = httpx.post(f"{live_server.url}/v1/completions", timeout=120,
                        json={"model": model_id, "prompt": "def f(", "max_tokens": 4, "temperature": 0})
    assert served.status_code == 200, served.text  # so every counter has a sample, whatever ran before
    response = httpx.get(f"{live_server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("specexec_requests_total", "specexec_prompt_tokens_total", "specexec_generation_tokens_total",
                 "specexec_queue_depth", "specexec_target_passes_total", "specexec_draft_tokens_accepted_total",
                 "specexec_accepted_tokens_per_pass_bucket", "specexec_step_seconds_bucket",
                 "specexec_requests_running", "specexec_scheduler_info"):
        assert re.search(rf"^{name}", text, re.MULTILINE), name
    assert 'policy="continuous-batching"' in text and 'max_running="4"' in text
    for name in ("specexec_requests_per_pass_bucket", "specexec_pass_emitted_tokens_bucket",
                 "specexec_prefix_cache_hit_tokens_total", "specexec_prefill_tokens_total"):
        assert re.search(rf"^{name}", text, re.MULTILINE), name
    assert metric(text, "specexec_target_passes_total") > 0
    # the metrics body is Prometheus text, not JSON
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_binds_loopback_by_default(live_server) -> None:
    proc_tcp = Path("/proc/net/tcp")
    if not proc_tcp.exists():
        pytest.skip("needs Linux /proc/net/tcp")
    port = f"{int(live_server.url.rsplit(':', 1)[1]):04X}"
    listening = [line.split()[1] for line in proc_tcp.read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and line.split()[1].endswith(f":{port}")]
    assert listening == [f"0100007F:{port}"]  # 127.0.0.1 only
