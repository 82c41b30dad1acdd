"""Several requests in one engine: every step scores all running trees in one target pass.

Each request's greedy output equals transformers' own greedy generate on the target (an independent
reference), whatever runs beside it: at several budgets, resident and streamed, with requests joining
and leaving mid-stream and one aborted in a batch. Seeded sampled output does not depend on the batch.
The prefix cache reuses a finished request's KV (cached_tokens), evicts least recently used slots,
and stays exact."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import FinishReason, Request, SamplingParams, TokenDelta
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [90, 12], [130, 131, 132, 133, 134, 135]]
LENGTHS = [30, 18, 40, 24]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=11)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def references(pair) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    return [reference_greedy(model, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]


def load(pair, budget: int = 16, offload: bool = False, **limits) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=budget, max_depth=6),
        offload=OffloadConfig(enabled=offload, resident_layers=0) if offload else OffloadConfig(),
        limits=LimitsConfig(max_context=256, **limits),
    ))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_all(engine: Engine, joins: dict[int, list[Request]], aborts: dict[int, str] | None = None) -> dict[str, list[TokenDelta]]:
    """Step until nothing runs; joins[k] are added before step k, aborts[k] aborted before step k."""
    deltas: dict[str, list[TokenDelta]] = {}
    step = 0
    while step <= max(joins) or engine.num_running:
        for request in joins.get(step, []):
            engine.add_request(request)
            deltas[request.request_id] = []
        if aborts and step in aborts:
            final = engine.abort_request(aborts[step])
            assert final is not None and final.finish_reason == FinishReason.ABORT
            deltas[aborts[step]].append(final)
        output = engine.step()
        assert not output.failures
        for delta in output.deltas:
            deltas[delta.request_id].append(delta)
        step += 1
    return deltas


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("budget,offload", [(4, False), (16, False), (48, False), (16, True)],
                         ids=["b4", "b16", "b48", "b16-streamed"])
def test_greedy_outputs_in_a_batch_equal_the_reference(pair, references, budget, offload) -> None:
    engine = load(pair, budget=budget, offload=offload)
    requests = [Request(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))]
    deltas = run_all(engine, {0: requests})
    for i, reference in enumerate(references):
        assert tokens(deltas[f"r{i}"]) == reference, i
        assert deltas[f"r{i}"][-1].finish_reason == FinishReason.LENGTH
    first = deltas["r0"][0].stats
    assert first is not None and first.batch_size == 4
    assert first.pass_tokens == sum(len(p) - 1 for p in PROMPTS) + sum(d[0].stats.tree_size for d in deltas.values())
    assert sum(d[0].stats.tree_size - 1 for d in deltas.values()) <= budget  # the budget is shared


def test_requests_join_and_leave_mid_stream(pair, references) -> None:
    """A long request runs; two join later (their first tokens come from the step they join); the
    shortest leaves first; every output equals the reference."""
    engine = load(pair, budget=16)
    joins = {0: [Request("long", PROMPTS[2], greedy(LENGTHS[2]))],
             3: [Request("a", PROMPTS[0], greedy(LENGTHS[0])), Request("b", PROMPTS[1], greedy(LENGTHS[1]))],
             5: [Request("c", PROMPTS[3], greedy(LENGTHS[3]))]}
    deltas = run_all(engine, joins)
    for name, index in (("long", 2), ("a", 0), ("b", 1), ("c", 3)):
        assert tokens(deltas[name]) == references[index], name
    assert deltas["a"][0].token_ids and deltas["a"][0].stats.batch_size == 3  # first tokens on joining
    assert deltas["long"][0].stats.batch_size == 1


def test_aborting_one_request_leaves_the_others_exact(pair, references) -> None:
    engine = load(pair, budget=16)
    requests = [Request(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))]
    deltas = run_all(engine, {0: requests}, aborts={2: "r2"})
    assert deltas["r2"][-1].finish_reason == FinishReason.ABORT
    assert tokens(deltas["r2"]) == references[2][: len(tokens(deltas["r2"]))]
    for i in (0, 1, 3):
        assert tokens(deltas[f"r{i}"]) == references[i]
    assert engine.pool.num_free == len(engine.pool.slots)


def test_seeded_sampling_does_not_depend_on_the_batch(pair) -> None:
    engine = load(pair, budget=16)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True) for i in range(3)]
    alone = [engine.generate_ids(PROMPTS[i], params[i]) for i in range(3)]
    together = run_all(engine, {0: [Request(f"s{i}", PROMPTS[i], params[i]) for i in range(3)]})
    assert [tokens(together[f"s{i}"]) for i in range(3)] == alone
    solo = load(pair, budget=16, prefix_cache_slots=0)  # no speculation at all: the same seeded text
    auto = solo.with_speculation(SpeculationConfig(method="autoregressive"))
    assert auto.generate_ids(PROMPTS[0], params[0]) == alone[0]


def test_a_second_turn_reuses_the_first_turns_kv(pair) -> None:
    engine = load(pair, budget=16)
    first = list(engine.generate(Request("t1", PROMPTS[1], greedy(12))))
    assert first[-1].totals.cached_tokens == 0
    answer = tokens(first)
    turn2 = PROMPTS[1] + answer + [60, 61, 62]
    second = list(engine.generate(Request("t2", turn2, greedy(10))))
    cached = second[-1].totals.cached_tokens
    assert cached == len(PROMPTS[1]) + len(answer) - 1  # all but the first answer's last token (no KV yet)
    assert second[0].stats.pass_tokens == len(turn2) - 1 - cached + second[0].stats.tree_size
    fresh = load(pair, budget=16, prefix_cache_slots=0)
    unshared = list(fresh.generate(Request("t2", turn2, greedy(10))))
    assert unshared[-1].totals.cached_tokens == 0
    assert tokens(second) == tokens(unshared)
    assert unshared[0].stats.pass_tokens == len(turn2) - 1 + unshared[0].stats.tree_size


def test_the_prefix_cache_evicts_the_least_recently_used_slot(pair) -> None:
    engine = load(pair, budget=8, max_running=1, prefix_cache_slots=1)  # two slots
    assert len(engine.pool.slots) == 2

    def cached(prompt: list[int]) -> int:
        deltas = list(engine.generate(Request("x", prompt, greedy(4))))
        return deltas[-1].totals.cached_tokens

    x, y, z = PROMPTS[1], PROMPTS[3], PROMPTS[0]
    assert cached(x) == 0 and cached(y) == 0
    assert cached(x) == len(x) - 1  # both still cached
    assert cached(z) == 0  # evicts y, the least recently used
    assert cached(y) == 0  # evicts x (used before z)
    assert cached(z) == len(z) - 1  # z's slot survived
