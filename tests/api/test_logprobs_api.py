"""logprobs over HTTP with the real openai SDK: OpenAI's shapes for chat and completions, streamed
and not, one entry per completion token. (The values themselves are checked against an independent
transformers reference in tests/speculation/test_logprobs.py.)"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.helpers.tiny_models import SPECIAL_TOKENS

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
PROMPT = "for i in range(10):\n"
GREEDY = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})


def check_chat_entries(content: list[Any], num_top: int, greedy: bool) -> None:
    for entry in content:
        assert isinstance(entry.token, str) and isinstance(entry.bytes, list) and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == num_top
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
        assert all(isinstance(top.token, str) and isinstance(top.bytes, list) for top in entry.top_logprobs)
        if greedy and num_top:
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


def text_of(content: list[Any]) -> str:
    """The tokens' exact bytes (special tokens, not part of the content, have no entries)."""
    return b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")


def test_chat_logprobs_non_streamed_and_streamed(client: openai.OpenAI, model_id: str) -> None:
    full = client.chat.completions.create(model=model_id, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                          **GREEDY)
    choice = full.choices[0]
    content = choice.logprobs.content
    assert len(content) <= full.usage.completion_tokens == 16  # special tokens, left out of the text, have none
    assert not any(e.token in SPECIAL_TOKENS for e in content)
    check_chat_entries(content, 3, greedy=True)
    assert text_of(content) == choice.message.content
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                 stream=True, **GREEDY))
    streamed = [e for c in chunks for e in ((c.choices[0].logprobs.content or []) if c.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_chat_logprobs_without_alternatives_and_sampled(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, logprobs=True, max_tokens=12,
                                         temperature=0.9, seed=4, extra_body={"top_k": 30, "ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) <= out.usage.completion_tokens == 12 and not any(e.token in SPECIAL_TOKENS for e in content)
    check_chat_entries(content, 0, greedy=False)
    assert all(-9999.0 <= e.logprob <= 0.0 for e in content)
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, logprobs=True, top_logprobs=20,
                                         max_tokens=6, temperature=0.9, extra_body={"top_k": 5, "ignore_eos": True})
    for entry in out.choices[0].logprobs.content:  # top_k=5 removed the rest: sent as -9999, JSON has no -inf
        assert [t.logprob for t in entry.top_logprobs][5:] == [-9999.0] * 15


def test_no_logprobs_unless_asked(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0)
    assert out.choices[0].logprobs is None
    out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].logprobs is None


def check_completion_logprobs(lp: Any, num_top: int, text: str) -> None:
    num = len(lp.tokens)
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0 and top[token] == pytest.approx(value, abs=1e-6)
        assert 1 <= len(top) <= num_top + 1  # the k most likely and the chosen token (keys may coincide)
        assert max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy: the chosen one is the most likely
    if not any("\ufffd" in t for t in lp.tokens):  # no token holds part of a character
        assert "".join(lp.tokens) == text  # so text_offset is each token's place in the text


def test_completions_logprobs_non_streamed_and_streamed(client: openai.OpenAI, model_id: str) -> None:
    full = client.completions.create(model=model_id, prompt=PROMPT, logprobs=2, **GREEDY)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) <= full.usage.completion_tokens == 16 and not set(lp.tokens) & set(SPECIAL_TOKENS)
    check_completion_logprobs(lp, 2, full.choices[0].text)
    chunks = [c for c in client.completions.create(model=model_id, prompt=PROMPT, logprobs=2, stream=True, **GREEDY)
              if c.choices]
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset  # offsets go on across chunks
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(lp.token_logprobs, abs=1e-5)
    zero = client.completions.create(model=model_id, prompt=PROMPT, logprobs=0, max_tokens=5, temperature=0)
    assert all(len(top) == 1 for top in zero.choices[0].logprobs.top_logprobs)
