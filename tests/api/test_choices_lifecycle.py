"""`n` > 1 over a FakeEngine: every choice's engine request is freed when the response is refused,
when a client goes away (streamed or not), and when the response completes."""

from __future__ import annotations

import httpx

from tests.helpers.fake_engine import FakeEngine
from tests.helpers.polling import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
# 3 x 3,000 steps of 0.02 s, one choice at a time: a minute per choice, so "given up" is never confused
# with "finished" however slowly the machine runs
SLOW = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "n": 3}


def wait_idle(srv) -> None:
    async_engine = srv.state.async_engine
    wait_until(lambda: async_engine.queue_depth == 0 and async_engine.num_running == 0, "an idle engine")


def test_choices_refused_by_the_queue_are_all_given_up(fake_server) -> None:
    engine = FakeEngine(step_seconds=0.02, max_context=100_000)
    srv = fake_server(engine, max_queue=1)
    response = httpx.post(srv.url + "/v1/chat/completions", json={**SLOW, "max_tokens": 300}, timeout=30)
    assert response.status_code == 429 and "retry-after" in response.headers
    wait_idle(srv)
    assert engine.steps_run < 100  # the two choices the queue took were given up, not run (100 steps each)
    ok = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "n": 2}, timeout=30)
    assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1]


def test_stream_disconnect_frees_every_choice(fake_server) -> None:
    engine = FakeEngine(step_seconds=0.02, tokens_per_step=1, max_context=100_000)
    srv = fake_server(engine)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**SLOW, "stream": True}, timeout=30) as resp:
        for line in resp.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first text arrived: go away
    wait_idle(srv)
    assert engine.steps_run < 3000  # the first choice was given up before its end, the others never ran


def test_non_stream_disconnect_frees_every_choice(fake_server) -> None:
    engine = FakeEngine(step_seconds=0.02, tokens_per_step=1, max_context=100_000)
    srv = fake_server(engine)
    try:
        httpx.post(srv.url + "/v1/chat/completions", json=SLOW, timeout=0.5)
    except httpx.ReadTimeout:
        pass
    wait_idle(srv)
    assert engine.steps_run < 3000  # the first choice was given up before its end, the others never ran


def test_choices_run_in_order_with_seed_plus_index(fake_server) -> None:
    engine = FakeEngine()
    srv = fake_server(engine)
    body = {**CHAT, "n": 3, "seed": 7, "temperature": 1.0}
    out = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert [r.params.seed for r in engine.requests] == [7, 8, 9]
    assert len({r.request_id for r in engine.requests}) == 3 and engine.requests[0].request_id == out["id"]
    texts = [c["message"]["content"] for c in out["choices"]]
    assert len(set(texts)) == 3  # the fake's output depends on the seed
    wait_idle(srv)
