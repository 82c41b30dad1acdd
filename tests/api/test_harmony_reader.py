"""The harmony reader (server/harmony.py) and its deltas (server/harmony_output.py), without a server:
every split of an output into three pieces reads the same as the whole; channels, recipients in either
place, cut-off messages; calls streamed or whole, past max_calls, without tools; past turns for the template."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from server.harmony import HarmonyReader, header_kind, speaks_harmony
from server.harmony_output import HarmonyOutput, harmony_conversation
from server.protocol import ChatMessage
from tests.helpers.harmony_models import GPT_OSS_TEMPLATE, HARMONY_TOKENS, harmony_tokenizer
from tests.helpers.tool_models import HERMES_TEMPLATE, tool_tokenizer

ANALYSIS_FINAL = ("<|channel|>analysis<|message|>We need to ... <|end|>"
                  "<|start|>assistant<|channel|>final<|message|>The answer is 4.")
CALL_AFTER = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')
RECIPIENT_FIRST = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Lyon"}'
PREAMBLE = ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>"
            "a <b> c <| d")


def read(text: str, cuts: tuple[int, ...] = (), **kwargs) -> list[tuple[str, str]]:
    """The reader's events over `text` cut at `cuts`, runs of one kind joined."""
    reader = HarmonyReader(**kwargs)
    bounds = (0, *cuts, len(text))
    events = [e for a, b in pairwise(bounds) for e in reader.feed(text[a:b])] + reader.finish()
    joined: list[tuple[str, str]] = []
    for kind, value in events:
        if joined and joined[-1][0] == kind and kind != "call":
            joined[-1] = (kind, joined[-1][1] + value)
        else:
            joined.append((kind, value))
    return joined


@pytest.mark.parametrize("text,expected", [
    (ANALYSIS_FINAL, [("reasoning", "We need to ... "), ("content", "The answer is 4.")]),
    (CALL_AFTER, [("reasoning", "Need weather."), ("call", "get_weather"), ("args", '{"city":"Paris"}')]),
    (RECIPIENT_FIRST, [("call", "get_weather"), ("args", '{"city": "Lyon"}')]),
    (PREAMBLE, [("content", "Let me look.\n\na <b> c <| d")]),
    ("Plain text, no channels <|end|>", [("content", "Plain text, no channels <|end|>")]),
], ids=["analysis-final", "call", "recipient-first", "preamble", "plain"])
def test_every_split_reads_as_the_whole(text: str, expected: list) -> None:
    assert read(text) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert read(text, (i, j)) == expected, (i, j)


@pytest.mark.parametrize("text,expected", [
    ("<|channel|>analysis<|message|>cut off mid", [("reasoning", "cut off mid")]),
    ("<|channel|>analysis<|message|>cut at a marker <|en", [("reasoning", "cut at a marker <|en")]),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", [("reasoning", "a")]),
    ("<|channel|>weird<|message|>x", [("content", "x")]),
    ("<|channel|>commentary to=browser.search<|message|>q", [("content", "q")]),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b",
     [("reasoning", "a\n\nb")]),
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b", [("reasoning", "a"), ("content", "b")]),
    ("<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>b", [("reasoning", "a"), ("content", "b")]),
    ("", []),
    ("  ", [("content", "  ")]),
])
def test_edges(text: str, expected: list) -> None:
    assert read(text) == expected


def test_reasoning_off_makes_analysis_content() -> None:
    assert read(ANALYSIS_FINAL, reasoning=False) == [("content", "We need to ... \n\nThe answer is 4.")]


@pytest.mark.parametrize("header,kind", [
    ("<|channel|>analysis", ("reasoning", "")),
    ("assistant<|channel|>final", ("content", "")),
    ("<|channel|>commentary to=functions.f <|constrain|>json", ("call", "f")),
    ("assistant to=functions.a.b<|channel|>commentary json", ("call", "a.b")),
    ("<|channel|>commentary", ("content", "")),
])
def test_header_kind(header: str, kind: tuple) -> None:
    assert header_kind(header) == kind


def test_detection() -> None:
    assert speaks_harmony(GPT_OSS_TEMPLATE, tool_tokenizer(HERMES_TEMPLATE))
    assert speaks_harmony("{{ messages }}", tool_tokenizer(HERMES_TEMPLATE, HARMONY_TOKENS))
    assert not speaks_harmony(HERMES_TEMPLATE, tool_tokenizer(HERMES_TEMPLATE))
    assert harmony_tokenizer().chat_template == GPT_OSS_TEMPLATE


def output_of(text: str, finish: str | None, cuts: tuple[int, ...] = (), **kwargs) -> list:
    out = HarmonyOutput(**kwargs)
    bounds = (0, *cuts, len(text))
    return [d for a, b in pairwise(bounds) for d in out.feed(text[a:b])] + out.finish(finish)


def test_eager_call_streams_its_arguments() -> None:
    deltas = output_of(CALL_AFTER, "stop", (len(CALL_AFTER) - 5,), calls=True, eager=True)
    entries = [d.tool_call for d in deltas if d.tool_call is not None]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" in entries[0]
    assert json.loads("".join(e["function"]["arguments"] for e in entries)) == {"city": "Paris"}
    assert len(entries) > 2  # the arguments came in pieces


def test_whole_call_comes_in_one_entry_and_finish_reason() -> None:
    out = HarmonyOutput(calls=True, eager=False)
    reasoning, content, calls = out.whole(CALL_AFTER, "stop")
    assert (reasoning, content) == ("Need weather.", None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_cut_off_call_whole_is_content_streamed_stays_a_call() -> None:
    cut = CALL_AFTER[:-4]
    assert HarmonyOutput(calls=True, eager=False).whole(cut, "length") == ("Need weather.", '{"city":"Par', None)
    deltas = output_of(cut, "length", calls=True, eager=True)
    assert "".join(d.tool_call["function"]["arguments"] for d in deltas if d.tool_call) == '{"city":"Par'


def test_without_tools_a_call_is_content_and_max_calls_drops_the_rest() -> None:
    assert HarmonyOutput(calls=False, eager=False).whole(CALL_AFTER, "stop") == \
        ("Need weather.", '{"city":"Paris"}', None)
    two = RECIPIENT_FIRST + "<|call|><|start|>assistant" + RECIPIENT_FIRST.replace("Lyon", "Nice")
    for eager in (False, True):
        _, _, calls = HarmonyOutput(calls=True, eager=eager, max_calls=1).whole(two, "stop")
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Lyon"}]
        _, _, calls = HarmonyOutput(calls=True, eager=eager).whole(two, "stop")
        assert len(calls) == 2


def test_past_turns_carry_thinking_for_the_template() -> None:
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "preamble", "reasoning_content": "Need weather.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
    ]]
    turns = harmony_conversation(messages)
    assert turns[1]["thinking"] == "Need weather." and turns[1]["content"] == ""
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert turns[3]["thinking"] == "Easy." and turns[3]["content"] == "Sunny."
    assert "thinking" not in turns[0] and "thinking" not in turns[2]
