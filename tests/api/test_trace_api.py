"""The `specexec` request field over a FakeEngine (fast): the trace's shape, that clients who do not ask
see nothing new, the trace against `timings`, and the request's own method (server/trace.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig, SpeculationConfig
from server.app import build_app
from server.config import ServerConfig
from tests.api.conftest import free_port, run_uvicorn
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.sse_helpers import assert_stream_invariants, post_stream

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}
COMPLETION = {"prompt": "def f(x):", "max_tokens": 10, "temperature": 0}
TRACE = {"specexec": {"trace": True}}


def traces(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["specexec"] for c in chunks if c["choices"]]


def check_against_timings(trace_parts: list[dict[str, Any]], text: str, timings: dict[str, Any]) -> None:
    """The trace's tokens spell the text; its passes and draft tokens are the timings' (no stop string)."""
    tokens = [t for part in trace_parts for t in part["tokens"]]
    passes = [p for part in trace_parts for p in part["passes"]]
    assert "".join(t["text"] for t in tokens) == text
    assert [p["pass"] for p in passes] == list(range(1, timings["target_passes"] + 1))
    assert sum(t["origin"] == "draft" for t in tokens) == timings["draft_tokens_accepted"]
    assert len(tokens) == timings["predicted_n"] == sum(p["emitted"] for p in passes)
    for p in passes:  # a pass's tokens: its accepted draft tokens, then the target's own
        origins = [t["origin"] for t in tokens if t["pass"] == p["pass"]]
        assert origins == ["draft"] * p["accepted"] + ["target"] * (p["emitted"] - p["accepted"])
        assert p["tree_size"] >= 1 and p["step_ms"] >= 0 and p["time_ms"] >= 0


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_without_the_field_chunks_have_no_trace(fake_server: Callable, chat: bool) -> None:
    srv = fake_server(FakeEngine())
    path, body = ("chat/completions", CHAT) if chat else ("completions", COMPLETION)
    stream = post_stream(f"{srv.url}/v1/{path}", body | {"stream": True})
    assert_stream_invariants(stream, chat, include_usage=False)
    assert all("specexec" not in c["choices"][0] for c in stream.chunks())
    whole = httpx.post(f"{srv.url}/v1/{path}", json=body | {"specexec": {"trace": False}}, timeout=30).json()
    assert "specexec" not in whole["choices"][0]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_trace_spells_the_text_and_agrees_with_timings(fake_server: Callable, chat: bool) -> None:
    srv = fake_server(FakeEngine(tokens_per_step=3))
    path, body = ("chat/completions", CHAT) if chat else ("completions", COMPLETION)
    stream = post_stream(f"{srv.url}/v1/{path}", body | TRACE | {"stream": True})
    text = assert_stream_invariants(stream, chat, include_usage=False)
    chunks = [c for c in stream.chunks() if c["choices"]]
    parts = traces(chunks)
    assert len(parts) == len(chunks) and parts[0]["method"] == "specexec"
    assert all("method" not in part for part in parts[1:])
    check_against_timings(parts, text, chunks[-1]["timings"])


def test_whole_response_carries_the_whole_trace(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine(tokens_per_step=4))
    out = httpx.post(f"{srv.url}/v1/completions", json=COMPLETION | TRACE, timeout=30).json()
    choice = out["choices"][0]
    check_against_timings([choice["specexec"]], choice["text"], out["timings"])


def test_each_choice_has_its_own_trace(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    body = CHAT | TRACE | {"n": 2, "seed": 3, "temperature": 0.7, "stream": True}
    chunks = post_stream(f"{srv.url}/v1/chat/completions", body).chunks()
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in mine)
        check_against_timings(traces(mine), text, mine[-1]["timings"])


def test_stop_string_leaves_its_tokens_out(fake_server: Callable) -> None:
    """The trace holds the tokens the text consumed, up to the one that completed the stop string."""
    srv = fake_server(FakeEngine(tokens_per_step=2))
    body = COMPLETION | TRACE | {"stop": "world", "stream": True, "max_tokens": 30}
    chunks = [c for c in post_stream(f"{srv.url}/v1/completions", body).chunks() if c["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    spelled = "".join(t["text"] for part in traces(chunks) for t in part["tokens"])
    assert text == "Hello, " and spelled.startswith(text + "world") and len(spelled) < len(text) + 10


def test_method_goes_to_the_engine_request(fake_server: Callable) -> None:
    engine = FakeEngine()
    srv = fake_server(engine)
    # the trees grown (the trace's `method`): greedy RRS requests grow SpecExec trees (the engine's rule)
    for method, trees in (("autoregressive", "autoregressive"), ("specinfer", "specinfer"), ("rrs", "specexec"),
                          ("specexec", "specexec"), (None, "specexec")):
        body = CHAT | {"specexec": {"method": method, "trace": True}}
        out = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
        assert out.status_code == 200, out.text
        assert engine.requests[-1].method == method
        assert out.json()["choices"][0]["specexec"]["method"] == trees
    httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert engine.requests[-1].method is None


@pytest.mark.parametrize("specexec,param", [
    ({"method": "beam"}, "specexec.method"),
    ({"trace": "yes"}, "specexec.trace"),
    ("trace", "specexec"),
])
def test_bad_field_is_a_400_naming_it(fake_server: Callable, specexec: Any, param: str) -> None:
    srv = fake_server(FakeEngine())
    out = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT | {"specexec": specexec}, timeout=30)
    assert out.status_code == 400
    assert out.json()["error"]["param"] == param


def test_without_a_draft_only_autoregressive_runs() -> None:
    port = free_port()
    config = EngineConfig(speculation=SpeculationConfig(method="autoregressive"))
    app = build_app(config, ServerConfig(port=port), FakeEngine())
    server, thread = run_uvicorn(app, port)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        refused = httpx.post(url, json=CHAT | {"specexec": {"method": "specexec"}}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "specexec.method"
        ran = httpx.post(url, json=CHAT | {"specexec": {"method": "autoregressive", "trace": True}}, timeout=30)
        assert ran.status_code == 200 and ran.json()["choices"][0]["specexec"]["method"] == "autoregressive"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
