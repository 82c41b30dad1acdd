"""A reasoning block before a structured output (engine.types.ReasoningBlock, engine/speculation/
reasoning_prefix.py): the grammar compiled for a tokenizer with think tags takes `<think>...</think>` and
then only what the request's grammar allows; the block is optional unless the prompt opened it; the
inner grammar keeps its checks (engine/speculation/schema_support.py), its JSON whitespace and its kind
in error messages. Outputs are fed as the tokenizer's own tokens (the tags as their single tokens) and
then EOS, which the grammar takes only at a complete output."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import xgrammar

from engine.speculation.grammar import GrammarCache
from engine.types import ReasoningBlock, StructuredOutput, StructuredOutputError
from server.toolcalls.grammar import tool_call_grammar
from tests.helpers.tiny_models import build_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
FREE = ReasoningBlock()
OPENED = ReasoningBlock(opened=True)


def think_tokenizer(special: bool):
    """The tiny tokenizer with `<think>` and `</think>` as added tokens: plain (Qwen3's, DeepSeek-R1's) or special."""
    tokenizer = copy.deepcopy(build_tokenizer())
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    else:
        tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module", params=[False, True], ids=["plain-tags", "special-tags"])
def cache(request) -> GrammarCache:
    tokenizer = think_tokenizer(request.param)
    return GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(cache: GrammarCache, spec: StructuredOutput, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer's tokens) and then ends (EOS)."""
    tokenizer = cache.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    for tag in ("<think>", "</think>"):
        assert text.count(tag) == ids.count(tokenizer.convert_tokens_to_ids(tag))  # each tag one token
    matcher = xgrammar.GrammarMatcher(cache.compile(spec))
    return all(matcher.accept_token(token) for token in ids) and matcher.accept_token(tokenizer.eos_token_id)


def test_a_block_may_come_first_then_only_the_schema(cache) -> None:
    spec = dataclasses.replace(JSON_SPEC, reasoning=FREE)
    for text in ['<think>reasoning</think>{"a": 1}', '{"a": 1}', '\n<think>\nLet me think.\n</think>\n\n{"a": 12}',
                 "<think></think>{\"a\": 0}"]:
        assert accepts(cache, spec, text), text
    for text in ['<think>r</think>{"a": "x"}', '<think>r</think>{"b": 1}', "<think>r</think>", "<think>r",
                 'reasoning</think>{"a": 1}', '<think>r</think>{"a":1}', '<think>r</think>{"a": 1}x',
                 '<think>a</think><think>b</think>{"a": 1}']:
        assert not accepts(cache, spec, text), text


def test_a_block_the_prompt_opened_starts_the_output(cache) -> None:
    spec = dataclasses.replace(JSON_SPEC, reasoning=OPENED)
    for text in ['reasoning</think>{"a": 1}', '\nstep 1\n</think>\n\n{"a": 1}', '</think>{"a": 2}']:
        assert accepts(cache, spec, text), text
    for text in ['{"a": 1}', 'r</think>{"a": "x"}', "r</think>"]:
        assert not accepts(cache, spec, text), text


def test_without_a_block_the_grammar_is_as_before(cache) -> None:
    assert accepts(cache, JSON_SPEC, '{"a": 1}')
    assert not accepts(cache, JSON_SPEC, '<think>r</think>{"a": 1}')


def test_every_kind_takes_the_block(cache) -> None:
    tools = tool_call_grammar("hermes", [("f", SCHEMA)], forced=True, single=True)
    cases = [(StructuredOutput("json_object"), '{"x": [1, "y"]}', "[1]"),
             (StructuredOutput("regex", "[a-c]{2}-[0-9]"), "ab-3", "ab-"),
             (tools, '<tool_call>\n{"name": "f", "arguments": {"a": 5}}\n</tool_call>', '{"a": 5}')]
    for spec, good, bad in cases:
        for block, head in ((FREE, "<think>hmm</think>\n"), (OPENED, "hmm</think>\n")):
            wrapped = dataclasses.replace(spec, reasoning=block)
            assert accepts(cache, wrapped, head + good), (spec.kind, block)
            assert not accepts(cache, wrapped, head + bad), (spec.kind, block)
        assert accepts(cache, dataclasses.replace(spec, reasoning=FREE), good)


def test_the_json_whitespace_setting_holds_after_the_block(cache) -> None:
    text = '<think>r</think>{ "a" :1 }'
    assert not accepts(cache, dataclasses.replace(JSON_SPEC, reasoning=FREE), text)
    assert accepts(cache, dataclasses.replace(JSON_SPEC, reasoning=FREE, json_whitespace="free"), text)


def test_the_inner_grammar_keeps_its_checks_and_its_errors(cache) -> None:
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(StructuredOutputError, match="uniqueItems"):
        cache.compile(StructuredOutput("json_schema", json.dumps(unique), reasoning=FREE))
    with pytest.raises(StructuredOutputError, match="the regex cannot be compiled"):
        cache.compile(StructuredOutput("regex", "a(b", reasoning=FREE))


def test_a_block_needs_both_tags() -> None:
    with pytest.raises(StructuredOutputError):
        ReasoningBlock(close="")


def test_mistral_think_tags_as_special_tokens() -> None:
    """Magistral's [THINK] / [/THINK] (special tokens of its tokenizer) open and close the block."""
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = dataclasses.replace(JSON_SPEC, reasoning=ReasoningBlock("[THINK]", "[/THINK]"))
    matcher_ok = xgrammar.GrammarMatcher(cache.compile(spec))
    ids = tokenizer.encode('[THINK]r[/THINK]{"a": 1}', add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("[THINK]")) == 1
    assert all(matcher_ok.accept_token(t) for t in ids) and matcher_ok.accept_token(tokenizer.eos_token_id)
    matcher_bad = xgrammar.GrammarMatcher(cache.compile(spec))
    bad = tokenizer.encode('[THINK]r[/THINK]{"a": "x"}', add_special_tokens=False)
    assert not (all(matcher_bad.accept_token(t) for t in bad) and matcher_bad.accept_token(tokenizer.eos_token_id))
