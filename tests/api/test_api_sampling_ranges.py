"""Sampling parameters at the edge of their ranges: a tiny temperature is greedy, and a value that
would make the logits NaN or infinite is a 400 naming the field (the live tiny-model server)."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import ServerProcess

pytestmark = pytest.mark.slow  # the live server (a `specexec serve` process)

PROMPT = "def add(a, b):"


def complete(server: ServerProcess, **fields: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def test_a_tiny_temperature_is_greedy(live_server):
    greedy = complete(live_server, temperature=0)
    assert greedy.status_code == 200, greedy.text
    for temperature in (1e-39, 1e-38, 1e-6):
        tiny = complete(live_server, temperature=temperature, seed=3)
        assert tiny.status_code == 200, tiny.text
        assert tiny.json()["usage"]["completion_tokens"] == 24
        assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"], temperature


def test_a_repetition_penalty_that_would_overflow_is_a_400_naming_it(live_server):
    for value in (1e-40, 0.001):
        response = complete(live_server, temperature=0, repetition_penalty=value)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "repetition_penalty"
        assert "0.01" in error["message"]  # the documented bound
