"""The calls' grammar (server/toolcalls/grammar.py) against the reader (server/toolcalls/stream.py), in
every format and tool_choice: what the grammar lets a model write, the reader reads as the same calls,
with arguments valid under the tool's schema (jsonschema), and no call markup in the content.

Random walks through the grammar (a random allowed token at each step, on the tiny test tokenizer
with the formats' markers as special tokens; tokens that close something, or EOS, are favoured so
walks end) stand in for a model that writes anything the grammar allows.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import xgrammar

from engine.speculation.grammar import GrammarCache
from server.detok import TextStream
from server.protocol import ChatCompletionRequest
from server.toolcalls.detect import ToolSupport
from server.toolcalls.plan import ToolPlan, plan_tools
from tests.helpers.tool_models import (
    GLM45_TEMPLATE,
    HERMES_TEMPLATE,
    LLAMA_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_CODER_TEMPLATE,
    TOOLS,
    tool_tokenizer,
)

SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
MODELS = {  # name -> (template, special tokens)
    "hermes": (HERMES_TEMPLATE, ()),
    "hermes-special": (HERMES_TEMPLATE, ("<tool_call>", "</tool_call>")),
    "llama3_json": (LLAMA_TEMPLATE, ("<|python_tag|>",)),
    "mistral": (MISTRAL_TEMPLATE, ("[TOOL_CALLS]",)),
    "mistral-named": (MISTRAL_TEMPLATE, ("[TOOL_CALLS]", "[ARGS]")),
    "qwen3_coder": (QWEN3_CODER_TEMPLATE, ()),
    "qwen3_coder-special": (QWEN3_CODER_TEMPLATE, ("<tool_call>", "</tool_call>")),
    "glm45": (GLM45_TEMPLATE, ()),
    "glm45-special": (GLM45_TEMPLATE, ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                       "</arg_value>")),
}
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")
XML_MARKERS = {"qwen3_coder": ("<function=",),  # opens a call without <tool_call> (the "auto" grammar keeps it out of text)
               "glm45": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")}
# texts a walk sometimes writes whole where the grammar allows them: a free-text XML value ends only at
# "</parameter>" (GLM: "</arg_value>"), which random tokens would almost never spell
CLOSERS = {"qwen3_coder": ("\n</parameter>\n", "</function>\n</tool_call>"),
           "glm45": ("</arg_value>\n", "</arg_value>\n</tool_call>", "\n<arg_key>unit</arg_key>\n<arg_value>")}
NUM_WALKS = 12
MAX_WALK_TOKENS = 160


def plan_for(model: str, **fields: Any) -> tuple[Any, ToolPlan]:
    template, special = MODELS[model]
    tokenizer = tool_tokenizer(template, special)
    support = ToolSupport.detect(tokenizer, template, "auto")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS} | fields
    plan = plan_tools(support, ChatCompletionRequest.model_validate(json.loads(json.dumps(body))))
    assert plan is not None
    return tokenizer, plan


def walk(tokenizer: Any, compiled: Any, rng: random.Random, start: str = "",
         closers: tuple[str, ...] = ()) -> tuple[list[int], bool]:
    """A random path through the grammar after `start`: (token ids without EOS, whether EOS ended it);
    now and then one of `closers` is written whole where the grammar takes it."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bits = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    ids: list[int] = tokenizer.encode(start, add_special_tokens=False)
    assert all(matcher.accept_token(token) for token in ids)
    texts = [tokenizer.decode([t]) for t in range(len(tokenizer))]
    while len(ids) < MAX_WALK_TOKENS:
        if closers and rng.random() < 0.1:
            closer = tokenizer.encode(rng.choice(closers), add_special_tokens=False)
            taken = 0
            while taken < len(closer) and matcher.accept_token(closer[taken]):
                taken += 1
            if taken == len(closer):
                ids += closer
                continue
            matcher.rollback(taken)
        matcher.fill_next_token_bitmask(bits)
        words = bits[0].tolist()
        allowed = [t for t in range(len(tokenizer)) if (words[t // 32] >> (t % 32)) & 1]
        closing = [t for t in allowed if t == tokenizer.eos_token_id or any(c in texts[t] for c in '"}]>')]
        token = rng.choice(closing if closing and rng.random() < 0.3 else allowed)
        if token == tokenizer.eos_token_id:
            return ids, True
        assert matcher.accept_token(token)
        ids.append(token)
    return ids, False


def read(plan: ToolPlan, tokenizer: Any, ids: list[int], eager: bool) -> tuple[str | None, list[tuple[str, Any]]]:
    text = TextStream(tokenizer, drop_ids=plan.drop_ids)
    output = plan.output(eager)
    if eager:
        deltas = [d for token in ids for d in output.feed(text.feed([token]))]
        deltas += output.feed(text.finish()) + output.finish()
        content = "".join(d.content for d in deltas if d.content is not None) or None
        args: dict[int, str] = {}
        names: dict[int, str] = {}
        for delta in deltas:
            if delta.tool_call is not None:
                if "id" in delta.tool_call:
                    names[delta.tool_call["index"]] = delta.tool_call["function"]["name"]
                args[delta.tool_call["index"]] = args.get(delta.tool_call["index"], "") + \
                    delta.tool_call["function"]["arguments"]
        return content, [(names[i], json.loads(args[i])) for i in sorted(names)]
    content, calls = output.message(text.feed(ids) + text.finish())
    return content or None, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [True, False])
def test_what_the_grammar_allows_the_reader_reads_as_valid_calls(model: str, choice: Any, parallel: bool) -> None:
    tokenizer, plan = plan_for(model, tool_choice=choice, parallel_tool_calls=parallel)
    compiled = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(plan.grammar)
    rng = random.Random(f"{model}-{choice}-{parallel}")
    num_calls = 0
    family = model.split("-")[0]
    opening = {"hermes": "Sure. <tool_call>", "llama3_json": "{", "mistral": "Sure. [TOOL_CALLS]",
               "qwen3_coder": "Sure. <tool_call>", "glm45": "Sure. <tool_call>"}
    markers = MARKERS + XML_MARKERS.get(family, ())
    for i in range(NUM_WALKS):
        start = opening[family] if choice == "auto" and i % 2 else ""  # "auto": half open a call
        ids, ended = walk(tokenizer, compiled, rng, start, CLOSERS.get(family, ()))
        if not ended:
            continue  # cut off (a real request: finish_reason "length")
        whole = read(plan, tokenizer, ids, eager=False)
        assert read(plan, tokenizer, ids, eager=True) == whole
        content, calls = whole
        assert not any(marker in (content or "") for marker in markers), (model, content)
        if choice != "auto":
            assert calls and content is None
        if isinstance(choice, dict):
            assert {name for name, _ in calls} == {"get_weather"}
        if not parallel or isinstance(choice, dict):
            assert len(calls) <= 1
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        num_calls += len(calls)
    assert num_calls


@pytest.mark.parametrize("model", list(MODELS))
def test_canonical_calls_are_accepted_and_read(model: str) -> None:
    tokenizer, plan = plan_for(model, tool_choice="required")
    compiled = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(plan.grammar)
    name, args = "get_weather", {"city": "Paris", "unit": "c"}
    text = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
            "mistral-named": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}',
            "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                           "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
            "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                     "<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>"}[model.replace("-special", "")]
    ids = tokenizer.encode(text, add_special_tokens=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    assert all(matcher.accept_token(token) for token in ids) and matcher.accept_token(tokenizer.eos_token_id)
    assert read(plan, tokenizer, ids, eager=False) == (None, [(name, args)])
    assert plan.grammar.special_tokens == tuple(t for t in MODELS[model][1] if t != "<|python_tag|>")


def test_arguments_are_always_an_object() -> None:
    from server.toolcalls.grammar import arguments

    assert arguments(None)["json_schema"] == {"type": "object"} and arguments({})["json_schema"] == {"type": "object"}
    assert arguments({"properties": {"a": {"type": "string"}}})["json_schema"] == {
        "type": "object", "properties": {"a": {"type": "string"}}}
    assert arguments({"type": "object", "required": []})["json_schema"] == {"type": "object", "required": []}
