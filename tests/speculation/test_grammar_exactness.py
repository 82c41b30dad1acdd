"""Structured output on the engine: constrained greedy with speculation equals constrained greedy
without it, and the grammar forces schema-valid output from a random tiny model (JSON schemas, regexes,
and the tool-call structural tags the server builds).

The reference shares no code with the engine's decoding: each token is `model(input_ids).logits[0,
-1]` of the transformers model, the tokens a fresh xgrammar matcher (fed the output so far) forbids
set to -inf, then argmax, until EOS. The grammar itself (the compiled schema) is the engine's, as the
definition of what is allowed. A mismatch at a floating-point near-tie counts as a tie, as in
tests/speculation/test_penalty_exactness.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch
import xgrammar
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import FinishReason, Request, SamplingParams, StructuredOutput
from tests.helpers.tiny_models import make_tiny_pair
from tests.speculation.test_penalty_exactness import first_difference

BUDGETS = [1, 8, 64]
MAX_TOKENS = 200
OBJECT_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
}
ENUM_SCHEMA = {"enum": ["alpha", "beta", "gamma", "delta"]}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,7}$"},
                                                "unit": {"enum": ["c", "f"]}}, "required": ["city"]}
TZ_SCHEMA = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}}
# tool calls as the server asks for them with tool_choice "required" and parallel_tool_calls false
# (server/toolcalls/grammar.py, Hermes format; compact JSON by default, and with json_whitespace "free"
# at most 2 whitespace characters per gap, so the random model finishes a call)
TOOL_CALLS = StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": {
    "type": "tags_with_separator", "separator": "\n", "at_least_one": True, "stop_after_first": True, "tags": [
        {"type": "tag", "begin": '<tool_call>\n{"name": "' + name + '", "arguments": ',
         "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 2}, "end": "}\n</tool_call>"}
        for name, schema in (("get_weather", CITY_SCHEMA), ("get_time", TZ_SCHEMA))]}}))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("grammar-pair"), arch="llama", draft="noisy", seed=3)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(pair) -> dict[tuple[str, int], Engine]:
    base = Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=max(BUDGETS)),
        limits=LimitsConfig(max_context=256),
    ))
    return {(method, budget): base.with_speculation(SpeculationConfig(method=method, budget=budget))
            for method in ("specexec", "specinfer") for budget in BUDGETS}


def schema_spec(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


@torch.no_grad()
def reference_constrained_greedy(model, engine: Engine, prompt: list[int], spec: StructuredOutput):
    """(tokens without EOS, whether EOS ended them, top-2 gap among allowed tokens at each step)."""
    matcher = xgrammar.GrammarMatcher(engine.grammars.compile(spec))
    bits = xgrammar.allocate_token_bitmask(1, model.config.vocab_size)
    output: list[int] = []
    gaps: list[float] = []
    eos = min(engine.eos_token_ids)
    while len(output) < MAX_TOKENS:
        logits = model(torch.tensor([prompt + output])).logits[0, -1].double()
        matcher.fill_next_token_bitmask(bits)
        words = bits[0].tolist()
        allowed = torch.tensor([bool((words[t // 32] >> (t % 32)) & 1) for t in range(logits.shape[0])])
        logits = logits.masked_fill(~allowed, float("-inf"))
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        token = int(logits.argmax())
        if token == eos:
            return output, True, gaps
        assert matcher.accept_token(token)
        output.append(token)
    return output, False, gaps


def prompts(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode("def add(a, b):"), engine.tokenizer.encode("Hello, world! The quick")]


@pytest.mark.parametrize("method", [pytest.param("specexec", marks=pytest.mark.slow), "specinfer"])
@pytest.mark.parametrize("spec", [schema_spec(OBJECT_SCHEMA), TOOL_CALLS,
                                  dataclasses.replace(TOOL_CALLS, json_whitespace="free")],
                         ids=["json_schema", "tool_calls", "tool_calls-free-whitespace"])
def test_constrained_greedy_equals_the_reference_loop(engines, target_model, method, spec):
    mismatches, ties, finished = [], 0, 0
    for prompt in prompts(engines[(method, 1)]):
        want, ended, gaps = reference_constrained_greedy(target_model, engines[(method, 1)], prompt, spec)
        finished += ended
        for budget in BUDGETS:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=spec)
            got = engines[(method, budget)].generate_ids(prompt, params)
            mismatch, tie = first_difference(got, want, gaps)
            ties += tie
            if mismatch:
                mismatches.append((len(prompt), budget))
    assert finished >= 1  # the grammar closed the object and the model took EOS
    assert not mismatches, f"(prompt_len, budget) that differ from the reference: {mismatches}"
    assert ties <= 1


def check_object(text: str) -> None:
    value = json.loads(text)
    assert text == json.dumps(value)  # compact JSON: json.dumps's separators, no other whitespace
    assert isinstance(value, dict) and set(value) == {"color", "count", "ok"}, value
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
    assert isinstance(value["ok"], bool)


def check_calls(text: str) -> None:
    calls = re.findall(r'<tool_call>\n\{"name": "(\w+)", "arguments": (.*?)\}\n</tool_call>', text, re.S)
    assert calls and "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls) == text
    for name, arguments in calls:
        assert arguments == json.dumps(json.loads(arguments))  # compact, as the chat templates print calls
        jsonschema.validate(json.loads(arguments), CITY_SCHEMA if name == "get_weather" else TZ_SCHEMA)


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[str, FinishReason | None, int]:
    ids: list[int] = []
    finish = None
    for delta in engine.generate(Request("grammar", prompt, params)):
        ids.extend(delta.token_ids)
        finish = delta.finish_reason
    return engine.tokenizer.decode(ids), finish, len(ids)


@pytest.mark.parametrize("method", ["specexec", pytest.param("specinfer", marks=pytest.mark.slow)])
def test_the_grammar_forces_schema_valid_output_from_a_random_model(engines, method):
    engine = engines[(method, 8)]
    prompt = prompts(engine)[0]
    cases = [(schema_spec(OBJECT_SCHEMA), check_object),
             (schema_spec(ENUM_SCHEMA), lambda text: json.loads(text) in ENUM_SCHEMA["enum"] or pytest.fail(text)),
             (StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
             (StructuredOutput("regex", r"[a-c]{2,4}-[0-9]{3}"),
              lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text) or pytest.fail(text)),
             (TOOL_CALLS, check_calls)]
    for spec, check in cases:
        for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, structured_output=spec)
            text, finish, _ = run(engine, prompt, params)
            assert finish == FinishReason.STOP, (spec.kind, text)
            check(text)


def test_the_end_of_the_grammar_ends_the_request_even_with_ignore_eos(engines):
    """With ignore_eos, EOS is output like text; the grammar's end still ends the request (stop)."""
    engine = engines[("specexec", 8)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            structured_output=schema_spec(ENUM_SCHEMA))
    text, finish, num_tokens = run(engine, prompts(engine)[0], params)
    assert finish == FinishReason.STOP
    assert text.endswith(engine.tokenizer.decode([min(engine.eos_token_ids)]))
    assert json.loads(text[: text.rindex('"') + 1]) in ENUM_SCHEMA["enum"]
    assert num_tokens < 20


@torch.no_grad()
def test_logprobs_are_those_of_the_constrained_distribution(engines, target_model):
    """Each reported log-prob is log_softmax of the target's logits with the grammar's forbidden
    tokens at -inf (a fresh matcher fed the output so far), and the alternatives are allowed tokens."""
    engine = engines[("specexec", 8)]
    spec = schema_spec(ENUM_SCHEMA)
    prompt = prompts(engine)[1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, structured_output=spec)
    ids, entries = [], []
    for delta in engine.generate(Request("logprobs", prompt, params)):
        ids.extend(delta.token_ids)
        entries.extend(delta.logprobs or [])
    assert len(entries) == len(ids) > 2
    matcher = xgrammar.GrammarMatcher(engine.grammars.compile(spec))
    bits = xgrammar.allocate_token_bitmask(1, target_model.config.vocab_size)
    raised = 0
    for pos, (token, entry) in enumerate(zip(ids, entries, strict=True)):
        logits = target_model(torch.tensor([prompt + ids[:pos]])).logits[0, -1].double()
        matcher.fill_next_token_bitmask(bits)
        words = bits[0].tolist()
        allowed = torch.tensor([bool((words[t // 32] >> (t % 32)) & 1) for t in range(logits.shape[0])])
        want = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
        assert abs(entry.logprob - float(want[token])) < 1e-4
        finite = [t for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True) if lp > float("-inf")]
        assert finite and all(bool(allowed[t]) for t in finite)
        raised += entry.logprob > float(logits.log_softmax(-1)[token]) + 1e-3  # renormalised over allowed
        assert matcher.accept_token(token)
    assert raised == len(ids)
