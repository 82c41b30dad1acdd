"""Reasoning tokens in usage (server/reasoning_tokens.py): chat's
`usage.completion_tokens_details.reasoning_tokens` (whole, and the stream's usage chunk) and the
Responses API's `usage.output_tokens_details.reasoning_tokens` (whole, and response.completed), through
the openai SDK, for a `<think>` model and a harmony model (GPT-OSS). The expectation is the tokenizer's
own count of the script's reasoning part, markup included; a model without reasoning has no
completion_tokens_details (as before) and 0 reasoning tokens on Responses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from server.harmony import HarmonyReader
from server.reasoning import ReasoningSplitter
from server.reasoning_tokens import ReasoningTokens
from tests.api.test_reasoning_api import OPENED_TEMPLATE, THINK_TEMPLATE
from tests.helpers.harmony_models import harmony_engine, harmony_tokenizer
from tests.helpers.tool_models import HERMES_TEMPLATE, scripted_engine, tool_tokenizer
from tests.helpers.tool_models import openai_client as oai

MESSAGES = [{"role": "user", "content": "hi"}]
THOUGHT = "<think>Two and two: 2 + 2 is 4, so say it.</think>"
ANSWER = "\n\nThe answer is 4."
HARMONY_THOUGHT = "<|channel|>analysis<|message|>We need to add 2 and 2. That is 4.<|end|>"
HARMONY_ANSWER = "<|start|>assistant<|channel|>final<|message|>The answer is 4."


def num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def served(fake_server: Callable, tokenizer: Any, thought: str, answer: str, end: str,
           engine: Callable[..., Any]) -> tuple[Any, int, int]:
    """The server, the reasoning's token count and the whole output's, from the tokenizer alone (the
    script's tokens split where the reasoning ends: checked, so the expectation is exact)."""
    script_ids = tokenizer.encode(thought + answer, add_special_tokens=False)
    expected = num_tokens(tokenizer, thought)
    assert script_ids[:expected] == tokenizer.encode(thought, add_special_tokens=False)
    return fake_server(engine(thought + answer + end)), expected, len(script_ids)


def think_server(fake_server: Callable, thought: str = THOUGHT, template: str = THINK_TEMPLATE,
                 tokens_per_step: int = 3) -> tuple[Any, int, int]:
    tokenizer = tool_tokenizer(template)
    return served(fake_server, tokenizer, thought, ANSWER, "<|end|>",
                  lambda script: scripted_engine(tokenizer, script, tokens_per_step))


def harmony_server(fake_server: Callable) -> tuple[Any, int, int]:
    return served(fake_server, harmony_tokenizer(), HARMONY_THOUGHT, HARMONY_ANSWER, "<|return|>",
                  lambda script: harmony_engine(script, tokens_per_step=2))


def chat_usages(srv: Any) -> tuple[Any, Any]:
    """The usage of a whole chat reply and of a stream's usage chunk."""
    client = oai(srv)
    whole = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=200).usage
    chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=200,
                                                 stream=True, stream_options={"include_usage": True}))
    usages = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usages) == 1 and chunks[-1].choices == []
    return whole, usages[0]


def responses_usages(srv: Any) -> tuple[Any, Any]:
    """The usage of a whole response and of the stream's response.completed."""
    client = oai(srv)
    whole = client.responses.create(model="fake-model", input="hi", max_output_tokens=200).usage
    events = list(client.responses.create(model="fake-model", input="hi", max_output_tokens=200, stream=True))
    assert events[-1].type == "response.completed"
    return whole, events[-1].response.usage


@pytest.mark.parametrize("model", ["think", "harmony"])
def test_chat_usage_counts_the_reasoning_tokens(fake_server, model) -> None:
    srv, reasoning, total = (think_server if model == "think" else harmony_server)(fake_server)
    for usage in chat_usages(srv):
        assert usage.completion_tokens == total
        assert usage.completion_tokens_details.reasoning_tokens == reasoning


@pytest.mark.parametrize("model", ["think", "harmony"])
def test_responses_usage_counts_the_reasoning_tokens(fake_server, model) -> None:
    srv, reasoning, total = (think_server if model == "think" else harmony_server)(fake_server)
    for usage in responses_usages(srv):
        assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (total, reasoning)


def test_a_prompt_that_opens_the_block_counts_from_the_first_token(fake_server) -> None:
    srv, reasoning, total = think_server(fake_server, "Two and two make 4.</think>", OPENED_TEMPLATE, 1)
    for usage in chat_usages(srv):
        assert usage.completion_tokens == total
        assert usage.completion_tokens_details.reasoning_tokens == reasoning


def test_a_reasoning_model_that_writes_no_block_has_zero(fake_server) -> None:
    srv, reasoning, total = think_server(fake_server, "")
    assert reasoning == 0
    for usage in chat_usages(srv):
        assert usage.completion_tokens == total and usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_cut_off_by_max_tokens_is_all_reasoning(fake_server) -> None:
    srv, _, _ = think_server(fake_server)
    usage = oai(srv).chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=12).usage
    assert (usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens) == (12, 12)


def test_without_reasoning_usage_is_as_before(fake_server) -> None:
    tokenizer = tool_tokenizer(HERMES_TEMPLATE)  # no think tags: the output is all content
    srv = fake_server(scripted_engine(tokenizer, THOUGHT + ANSWER + "<|end|>", 3))
    for usage in chat_usages(srv):
        assert usage.completion_tokens == num_tokens(tokenizer, THOUGHT + ANSWER)
        assert usage.completion_tokens_details is None
    for usage in responses_usages(srv):
        assert usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_format_none_counts_no_reasoning(fake_server) -> None:
    tokenizer = tool_tokenizer(THINK_TEMPLATE)
    srv = fake_server(scripted_engine(tokenizer, THOUGHT + ANSWER + "<|end|>", 3), reasoning_format="none")
    for usage in chat_usages(srv):
        assert usage.completion_tokens_details is None


def test_n_choices_sum_their_reasoning(fake_server) -> None:
    srv, reasoning, total = think_server(fake_server)
    usage = oai(srv).chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=200, n=2).usage
    assert usage.completion_tokens == 2 * total
    assert usage.completion_tokens_details.reasoning_tokens == 2 * reasoning


def count(reader: Any, texts: list[str]) -> int:
    counter = ReasoningTokens(reader)
    for text in texts:
        counter.feed(text)
    return counter.num_tokens


@pytest.mark.parametrize(("texts", "expected"), [
    (["<think>", "a", " b", "</", "think>", "\n\n", "ans", "wer"], 5),  # both tags are reasoning
    (["<think>", "a b</", "think>ans", "wer"], 3),  # a token across `</think>` is reasoning
    (["\n", "<th", "ink>", "a", "</think>", "x"], 5),  # whitespace before the block goes with it
    (["\n", "hi", "<think>", "a"], 0),  # no block at the start: all content
    (["<think>", "a", "", "b"], 4),  # a token of an incomplete character ("") where it stands
    (["<think>", "a", "b"], 3),  # cut off inside the block
])
def test_think_tokens_by_the_rule(texts, expected) -> None:
    assert count(ReasoningSplitter(), texts) == expected


def test_opened_block_counts_from_the_first_token() -> None:
    assert count(ReasoningSplitter(inside=True), ["a", " b", "</think>", "\n", "x"]) == 3


def test_harmony_tokens_by_the_rule() -> None:
    analysis = ["<|channel|>", "analysis", "<|message|>", "Hi", ".", "<|end|>"]  # all reasoning
    start = ["<|start|>", "assistant"]  # between messages: goes with the message it opens
    final = ["<|channel|>", "final", "<|message|>", "Ok"]
    call = ["<|channel|>", "commentary", " to=functions.f", "<|message|>", "{}"]
    assert count(HarmonyReader(), analysis + start + final) == 6
    assert count(HarmonyReader(), analysis + start + call) == 6
    assert count(HarmonyReader(), final + ["<|end|>"] + start + analysis) == 8
    assert count(HarmonyReader(), ["plain", " text"]) == 0
