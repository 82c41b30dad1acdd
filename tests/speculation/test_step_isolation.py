"""A failure that belongs to one request fails that request alone; the others in the pass go on and
stay exact (transformers' greedy generate as the reference). And a long prompt that joins running
requests is written in slices across steps, while they keep emitting tokens."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation import batch as batch_module
from engine.types import Request, SamplingParams, StructuredOutput, StructuredOutputError
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [90, 12]]
LENGTH = 20
LONG_PROMPT = [(7 * i + 3) % 300 + 3 for i in range(700)]  # longer than one prefill chunk (512)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=5, max_positions=1024)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def model(pair):
    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)


def load(pair, offload: bool = False, **limits) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=16, max_depth=6),
        offload=OffloadConfig(enabled=offload, resident_layers=0, source="disk") if offload else OffloadConfig(),
        limits=LimitsConfig(max_context=1024, **limits),
    ))


def greedy(**fields) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": LENGTH, "ignore_eos": True, **fields})


def drive(engine: Engine, joins: dict[int, list[Request]]) -> tuple[dict[str, list[int]], dict[str, BaseException], list]:
    """Step until nothing runs; joins[k] are added before step k. Tokens, failures and each step's output."""
    tokens: dict[str, list[int]] = {}
    failures: dict[str, BaseException] = {}
    steps = []
    step = 0
    while step <= max(joins) or engine.num_running:
        for request in joins.get(step, []):
            engine.add_request(request)
            tokens[request.request_id] = []
        output = engine.step()
        steps.append(output)
        failures.update(output.failures)
        for delta in output.deltas:
            tokens[delta.request_id] += delta.token_ids
        step += 1
    return tokens, failures, steps


EMPTY = {"regex": StructuredOutput("regex", "[^\\s\\S]"),  # allows no first token
         # allows '"', then nothing: a dead end after the first token
         "dead-end": StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "[^\\s\\S]"}))}


@pytest.mark.parametrize("empty", list(EMPTY))
def test_an_empty_grammar_fails_alone(pair, model, empty) -> None:
    """A regex that matches nothing, or a string pattern that matches nothing, compiles; its request
    fails with a StructuredOutputError (no tree node is sampled from an empty distribution, no assertion
    trips), and the three beside it finish exactly."""
    engine = load(pair)
    spec = EMPTY[empty]
    requests = [Request(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]
    requests.insert(1, Request("bad", PROMPTS[0], greedy(structured_output=spec)))
    tokens, failures, _ = drive(engine, {0: requests})
    assert list(failures) == ["bad"] and isinstance(failures["bad"], StructuredOutputError)
    assert "allows no token" in str(failures["bad"])
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == reference_greedy(model, prompt, LENGTH), i
    assert engine.pool.num_free == len(engine.pool.slots)


def test_an_error_in_one_requests_verification_fails_it_alone(pair, model, monkeypatch) -> None:
    engine = load(pair)
    commit_step = batch_module.commit_step

    def failing(ctx, seq, tree, logits, grown=None):
        if seq.token_ids[: len(PROMPTS[1])] == PROMPTS[1] and seq.emitted >= 5:
            raise ValueError("this request's sampling broke")
        return commit_step(ctx, seq, tree, logits, grown)

    monkeypatch.setattr(batch_module, "commit_step", failing)
    tokens, failures, _ = drive(engine, {0: [Request(f"r{i}", p, greedy()) for i, p in enumerate(PROMPTS)]})
    assert list(failures) == ["r1"] and "sampling broke" in str(failures["r1"])
    for i in (0, 2):
        assert tokens[f"r{i}"] == reference_greedy(model, PROMPTS[i], LENGTH), i


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "disk"])
def test_a_long_prompt_joins_in_slices(pair, model, offload) -> None:
    """While r0 decodes, a 700-token prompt is written 64 tokens per pass: r0 gets tokens every step,
    the long request's output (and r0's) equals the reference."""
    engine = load(pair, offload=offload, prefill_slice=64)
    joins = {0: [Request("r0", PROMPTS[0], greedy(max_tokens=60))], 2: [Request("long", LONG_PROMPT, greedy())]}
    tokens, failures, steps = drive(engine, joins)
    assert not failures
    assert tokens["r0"] == reference_greedy(model, PROMPTS[0], 60)
    assert tokens["long"] == reference_greedy(model, LONG_PROMPT, LENGTH)
    prefill = [step.stats.num_prefill_tokens for step in steps[2:] if step.stats is not None]
    filling = [n for n in prefill if n > 0]
    assert max(filling) <= 64 and sum(filling) == len(LONG_PROMPT) - 1  # the root is scored as a tree
    assert len(filling) >= (len(LONG_PROMPT) - 1) // 64
    for step in steps[2 : 2 + len(filling)]:
        assert any(delta.request_id == "r0" and delta.token_ids for delta in step.deltas)


def test_a_long_prompt_alone_is_written_in_one_pass(pair, model) -> None:
    """Nobody waits: the whole prompt goes in the first pass (chunked layer-major), as before."""
    engine = load(pair, prefill_slice=64)
    tokens, _, steps = drive(engine, {0: [Request("long", LONG_PROMPT, greedy())]})
    assert tokens["long"] == reference_greedy(model, LONG_PROMPT, LENGTH)
    assert steps[0].stats.num_prefill_tokens == len(LONG_PROMPT) - 1


def test_the_prefix_cache_works_across_slices(pair, model) -> None:
    engine = load(pair, prefill_slice=64)
    first, _, _ = drive(engine, {0: [Request("r0", PROMPTS[0], greedy(max_tokens=40))],
                                 1: [Request("long", LONG_PROMPT, greedy())]})
    turn2 = LONG_PROMPT + first["long"] + [11, 12, 13]
    second, _, steps = drive(engine, {0: [Request("r0", PROMPTS[1], greedy(max_tokens=40))],
                                      1: [Request("turn2", turn2, greedy())]})
    assert second["turn2"] == reference_greedy(model, turn2, LENGTH)
    written = sum(step.stats.num_prefill_tokens for step in steps[1:] if step.stats is not None)
    assert written <= len(turn2) - len(LONG_PROMPT)  # the first turn's KV was reused
