"""Incremental detokenization and stop strings across token boundaries (no server)."""

from __future__ import annotations

import httpx
import pytest

from server.detok import REPLACEMENT_CHAR, Detokenizer, StopMatcher, TextStream
from tests.helpers.fake_engine import SCRIPT, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_detokenizer_never_emits_half_a_character(tok) -> None:
    ids = tok.encode(SCRIPT * 2, add_special_tokens=False)
    # the tiny BPE splits multi-byte characters over several tokens
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)
    detok = Detokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


def test_detokenizer_skips_special_tokens_and_flushes_incomplete_bytes(tok) -> None:
    text_ids = tok.encode("ok 日", add_special_tokens=False)
    detok = Detokenizer(tok)
    out = "".join(detok.add(i) for i in [*text_ids[:-1], tok.eos_token_id])
    out += detok.flush()
    assert "<|end|>" not in out and out.startswith("ok ")
    assert out.endswith(REPLACEMENT_CHAR)  # the last byte of 日 never arrived


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "matched"),
    [
        (["Hello wor", "ld, bye"], ["world"], "Hello ", "world"),
        (["a", "b", "c", "d", "e"], ["cd"], "ab", "cd"),
        (["abc", "xy"], ["cx"], "ab", "cx"),
        (["no stop here"], ["zzz"], "no stop here", None),
        (["ab", "ab", "c"], ["abc"], "ab", "abc"),  # a false start, then the real match
        (["xx STOP", " yy END"], ["END", "STOP"], "xx ", "STOP"),  # the earliest wins
        (["tail: ST"], ["STOP"], "tail: ST", None),  # held back, then flushed at the end
        (["", "x"], [], "x", None),
    ],
)
def test_stop_matcher_across_boundaries(pieces: list[str], stops: list[str], expected: str,
                                        matched: str | None) -> None:
    matcher = StopMatcher(stops)
    assert feed_all(matcher, pieces) == expected
    assert matcher.matched == matched


def test_stop_matcher_holds_back_only_possible_starts() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("x = 1 <") == "x = 1 "
    assert matcher.feed("/ans") == ""
    assert matcher.feed("wer> more") == ""
    assert matcher.matched == "</answer>"
    assert matcher.feed("after") == ""


def test_text_stream_stop_over_tokens_counts_tokens_to_the_stop(tok) -> None:
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    full = tok.decode(ids)
    stop = "brown fox"
    stream = TextStream(tok, [stop])
    out = "".join(stream.feed([i]) for i in ids) + stream.finish()
    assert out == full[: full.index(stop)]
    assert stream.stopped
    # the token that completed the stop string is counted, nothing after it
    assert stop in tok.decode(ids[: stream.num_tokens])
    assert stop not in tok.decode(ids[: stream.num_tokens - 1])


def test_text_stream_in_one_feed_stops_mid_delta(tok) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    stream = TextStream(tok, ["three"])
    assert stream.feed(ids) == "one two "
    assert stream.stopped and stream.num_tokens < len(ids)
    assert stream.feed(ids) == "" and stream.finish() == ""


def test_text_stream_without_stop_returns_everything(tok) -> None:
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    stream = TextStream(tok, ["never-there"])
    out = "".join(stream.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)) + stream.finish()
    assert out == tok.decode(ids) and not stream.stopped and stream.num_tokens == len(ids)


def test_logprobs_leave_out_the_special_tokens_the_text_leaves_out(fake_server) -> None:
    """A special token inside the output (here <|pad|>) is not in the text, so it has no logprobs entry and
    completions' text_offset stays each token's place in the text."""
    from tests.helpers.fake_engine import FakeEngine

    srv = fake_server(FakeEngine(script="ab<|pad|>cd<|end|>", tokens_per_step=2))
    body = {"model": "fake-model", "max_tokens": 40, "temperature": 0}
    chat = httpx.post(srv.url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 1,
                                                               "messages": [{"role": "user", "content": "hi"}]}).json()
    choice = chat["choices"][0]
    assert choice["message"]["content"] == "abcd"
    assert "".join(e["token"] for e in choice["logprobs"]["content"]) == "abcd"
    completion = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": "hi", "logprobs": 1}).json()
    lp = completion["choices"][0]["logprobs"]
    assert completion["choices"][0]["text"] == "abcd" and "".join(lp["tokens"]) == "abcd"
    assert [completion["choices"][0]["text"][offset:] for offset in lp["text_offset"]][-1] == lp["tokens"][-1]


def test_timings_of_an_answer_from_one_pass_and_a_cut_stop() -> None:
    from engine.types import GenerationStats
    from server.generation import timings

    one_pass = GenerationStats(prompt_tokens=40, completion_tokens=5, target_passes=1, accepted_tokens=6,
                               prefill_seconds=0.25, decode_seconds=0.0)
    out = timings(one_pass, 40, 5)
    assert out["predicted_ms"] == 250.0 and out["generation_tokens_per_second"] == 20.0  # the prompt's pass made them
    assert out["draft_tokens_accepted"] == 5 and out["mean_draft_accepted_per_pass"] == 5.0
    assert timings(GenerationStats(prefill_seconds=0.25), 40, 0)["predicted_ms"] == 0.0
