"""A reasoning block before the grammar on the engine: speculative greedy decoding (SpecExec, SpecInfer)
under the wrapped grammar equals autoregressive greedy under it, token for token, at several budgets;
and the output is the block, then text valid under the request's grammar.

The pair is the thinking bigram model (tests/helpers/think_model.py): it writes `<think>Pick red.</think>{`
when it may, its noise chooses the JSON's values, and its draft disagrees with it off that script, so
trees are rejected in part. Prompts: the chat prompt (the block optional), and the same prompt ending in
`<think>` (the output starts inside the block)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import ReasoningBlock, Request, SamplingParams, StructuredOutput
from server.toolcalls.grammar import tool_call_grammar
from tests.helpers.think_model import CLOSE, OPEN, REASONING, make_think_pair

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "count"], "additionalProperties": False}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
TOOL_SPEC = tool_call_grammar("hermes", [("pick", SCHEMA)], forced=True, single=True)
BUDGETS = [1, 4, 16]
MAX_TOKENS = 128  # the block and a Hermes call: about 100 tokens of the tiny vocabulary


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_think_pair(tmp_path_factory.mktemp("think-pair"))
    return str(target), str(draft)


@pytest.fixture(scope="module")
def engines(pair) -> dict[tuple[str, int], Engine]:
    target, draft = pair
    base = Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(draft)),
                                    speculation=SpeculationConfig(budget=max(BUDGETS)),
                                    limits=LimitsConfig(max_context=256)))
    out = {(method, budget): base.with_speculation(SpeculationConfig(method=method, budget=budget))
           for method in ("specexec", "specinfer") for budget in BUDGETS}
    out[("autoregressive", 1)] = base.with_speculation(SpeculationConfig(method="autoregressive"))
    return out


def chat_prompt(engine: Engine, opened: bool) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Pick a color."}],
                                                add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text + (OPEN if opened else ""), add_special_tokens=False)


def answer(text: str, opened: bool) -> str:
    """The text after the block, which the output holds (as the model prefers)."""
    head = REASONING + CLOSE if opened else OPEN + REASONING + CLOSE
    assert text.startswith(head), text
    return text[len(head):].lstrip()


@pytest.mark.parametrize("method", ["specexec", "specinfer"])
@pytest.mark.parametrize("opened", [False, True], ids=["block-optional", "prompt-opened"])
@pytest.mark.parametrize("spec", [JSON_SPEC, TOOL_SPEC], ids=["json_schema", "tool_calls"])
def test_speculative_greedy_equals_autoregressive_under_the_wrapped_grammar(engines, method, opened, spec) -> None:
    wrapped = dataclasses.replace(spec, reasoning=ReasoningBlock(opened=opened))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=wrapped)
    reference = engines[("autoregressive", 1)]
    prompt = chat_prompt(reference, opened)
    want = reference.generate_ids(prompt, params)
    text = reference.tokenizer.decode(want)
    rest = answer(text, opened)
    import jsonschema  # here, not at the top: tests/model/test_draft_graphs imports JSON_SPEC on machines without it

    if spec is JSON_SPEC:
        jsonschema.validate(json.loads(rest), SCHEMA)
    else:
        head, tail = '<tool_call>\n{"name": "pick", "arguments": ', "}\n</tool_call>"
        assert rest.startswith(head) and rest.endswith(tail), rest
        jsonschema.validate(json.loads(rest[len(head):-len(tail)]), SCHEMA)
    for budget in BUDGETS:
        assert engines[(method, budget)].generate_ids(prompt, params) == want, (budget, text)


def test_batched_and_streamed_with_overlap_equal_autoregressive(pair, engines) -> None:
    """Both wrapped grammars (block optional; block opened by the prompt) in one target pass, the target
    streamed from RAM, overlap on: each request's tokens are its autoregressive ones."""
    cases = [(JSON_SPEC, False), (TOOL_SPEC, True)]
    reference = engines[("autoregressive", 1)]
    requests, want = [], {}
    for i, (spec, opened) in enumerate(cases):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                structured_output=dataclasses.replace(spec, reasoning=ReasoningBlock(opened=opened)))
        prompt = chat_prompt(reference, opened)
        want[f"r{i}"] = reference.generate_ids(prompt, params)
        answer(reference.tokenizer.decode(want[f"r{i}"]), opened)  # the block came first
        requests.append(Request(f"r{i}", prompt, params))
    target, draft = pair
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=target, draft=draft), speculation=SpeculationConfig(budget=16, overlap=True),
        offload=OffloadConfig(enabled=True, source="ram", resident_layers=0), limits=LimitsConfig(max_context=256)))
    try:
        for request in requests:
            engine.add_request(request)
        got: dict[str, list[int]] = {request.request_id: [] for request in requests}
        shared = 0  # steps whose target pass served both requests
        while engine.num_running:
            output = engine.step()
            shared += output.stats is not None and output.stats.num_requests == 2
            for delta in output.deltas:
                got[delta.request_id] += delta.token_ids
    finally:
        engine.close()
    assert got == want
    assert shared > 0
