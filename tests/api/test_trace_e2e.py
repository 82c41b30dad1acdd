"""The `specexec` request field against a real `specexec serve` over the tiny pair: tracing leaves the text
as it is (greedy and seeded), the per-chunk trace agrees with the final `timings`, and a request run
autoregressive (`"specexec": {"method": "autoregressive"}`) returns the speculative run's text."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import ServerProcess
from tests.api.test_trace_api import check_against_timings, traces
from tests.helpers.sse_helpers import assert_stream_invariants, post_stream

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
PROMPT = "for i in range(10):\n"
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1234}}


def stream(server: ServerProcess, chat: bool, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The streamed text and the choice chunks."""
    path, prompt = ("chat/completions", {"messages": MESSAGES}) if chat else ("completions", {"prompt": PROMPT})
    raw = post_stream(f"{server.url}/v1/{path}", prompt | {"max_tokens": 40, "stream": True} | body, timeout=120)
    text = assert_stream_invariants(raw, chat, include_usage=False)
    return text, [c for c in raw.chunks() if c["choices"]]


@pytest.mark.parametrize("sampling", SAMPLING, ids=list(SAMPLING))
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_trace_leaves_the_text_and_agrees_with_timings(live_server: ServerProcess, chat: bool, sampling: str) -> None:
    plain, plain_chunks = stream(live_server, chat, SAMPLING[sampling])
    traced, chunks = stream(live_server, chat, SAMPLING[sampling] | {"specexec": {"trace": True}})
    assert traced == plain and plain
    assert all("specexec" not in c["choices"][0] for c in plain_chunks)
    parts = traces(chunks)
    timings = chunks[-1]["timings"]
    check_against_timings(parts, traced, timings)
    passes = [p for part in parts for p in part["passes"]]
    assert timings["draft_tokens_accepted"] > 0  # the tiny pair's draft is a noisy copy: it is accepted
    assert max(p["tree_size"] for p in passes) > 1 and all(p["batch_size"] >= 1 for p in passes)
    if len(passes) > 1:  # the first pass also wrote the prompt: timed as prompt_ms
        later = sum(p["step_ms"] for p in passes[1:])
        assert later == pytest.approx(timings["predicted_ms"], abs=0.002 * len(passes))


@pytest.mark.parametrize("sampling", SAMPLING, ids=list(SAMPLING))
def test_autoregressive_request_returns_the_speculative_text(live_server: ServerProcess, sampling: str) -> None:
    speculative, spec_chunks = stream(live_server, True, SAMPLING[sampling] | {"specexec": {"trace": True}})
    body = SAMPLING[sampling] | {"specexec": {"trace": True, "method": "autoregressive"}}
    auto, chunks = stream(live_server, True, body)
    assert auto == speculative
    timings = chunks[-1]["timings"]
    check_against_timings(traces(chunks), auto, timings)
    assert traces(chunks)[0]["method"] == "autoregressive" and traces(spec_chunks)[0]["method"] == "specexec"
    assert timings["target_passes"] == timings["predicted_n"] and timings["draft_tokens_accepted"] == 0
    assert all(p["tree_size"] == 1 for part in traces(chunks) for p in part["passes"])
    assert spec_chunks[-1]["timings"]["target_passes"] < timings["target_passes"]
