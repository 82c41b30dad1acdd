"""`n` > 1 over HTTP with the real openai SDK: n independent choices (seed + i per choice), an index
per choice, usage with the prompt counted once, streamed chunks tagged with their choice's index,
one finish chunk per choice and one [DONE]."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.sse_helpers import post_stream

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
PROMPT = "for i in range(10):\n"
SAMPLED = dict(max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})


def chat_texts(out: Any) -> list[str]:
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.message.content for c in out.choices]


def test_chat_n3_seeded_reproducible_and_distinct(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, n=3, seed=11, logprobs=True, **SAMPLED)
    texts = chat_texts(out)
    assert len(texts) == 3 and len(set(texts)) > 1
    single = client.chat.completions.create(model=model_id, messages=MESSAGES, seed=11, **SAMPLED)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices) == 30
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert all(c.finish_reason == "length" for c in out.choices)
    again = client.chat.completions.create(model=model_id, messages=MESSAGES, n=3, seed=11, **SAMPLED)
    assert chat_texts(again) == texts
    for index in range(3):  # choice i is the request with seed + i
        alone = client.chat.completions.create(model=model_id, messages=MESSAGES, seed=11 + index, **SAMPLED)
        assert alone.choices[0].message.content == texts[index]


def test_greedy_n2_gives_identical_choices(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, n=2, max_tokens=12, temperature=0)
    first, second = chat_texts(out)
    assert first == second
    out = client.completions.create(model=model_id, prompt=PROMPT, n=2, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text == out.choices[1].text


def test_chat_n3_streamed(client: openai.OpenAI, model_id: str) -> None:
    full = client.chat.completions.create(model=model_id, messages=MESSAGES, n=3, seed=5, **SAMPLED)
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, n=3, seed=5, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED))
    assert {c.id for c in chunks} == {chunks[0].id}
    by_index: dict[int, list[Any]] = defaultdict(list)
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        by_index[chunk.choices[0].index].append(chunk.choices[0])
    assert sorted(by_index) == [0, 1, 2]
    for index, choices in by_index.items():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in choices) == full.choices[index].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completions_n3_streamed_and_not(live_server, client: openai.OpenAI, model_id: str) -> None:
    full = client.completions.create(model=model_id, prompt=PROMPT, n=3, seed=8, **SAMPLED)
    assert [c.index for c in full.choices] == [0, 1, 2] and full.usage.completion_tokens == 30
    body = {"model": model_id, "prompt": PROMPT, "n": 3, "seed": 8, "stream": True, "max_tokens": 10,
            "temperature": 1.0, "ignore_eos": True}
    stream = post_stream(f"{live_server.url}/v1/completions", body)
    assert stream.status == 200 and stream.data.count("[DONE]") == 1 and stream.data[-1] == "[DONE]"
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[Any]] = defaultdict(list)
    for chunk in stream.chunks():
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]].append(choice["finish_reason"])
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]
    for index in range(3):
        assert finishes[index][-1] == "length" and set(finishes[index][:-1]) <= {None}


def test_n_above_the_limit_is_a_400_naming_n(live_server, model_id: str) -> None:
    body = {"model": model_id, "messages": MESSAGES, "n": 9}
    response = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
