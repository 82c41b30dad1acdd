"""A request's own speculation method (`Request.method`): the same engine runs it autoregressive or
with another method, and the output is the speculative run's, greedy (equal to transformers' greedy)
and seeded; an autoregressive request beside speculative ones grows no tree and takes no budget."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams, TokenDelta
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.tiny_models import make_tiny_pair

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
NUM_TOKENS = 24
BUDGET = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=11)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def engine(pair) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=BUDGET, max_depth=6),
        limits=LimitsConfig(max_context=256),
    ))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=NUM_TOKENS, ignore_eos=True)


def run(engine: Engine, request: Request) -> list[TokenDelta]:
    return list(engine.generate(request))


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_greedy_equals_the_reference_under_every_method(pair, engine: Engine) -> None:
    reference = reference_greedy(AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32),
                                 PROMPTS[1], NUM_TOKENS)
    speculative = run(engine, Request("spec", PROMPTS[1], greedy()))
    assert tokens(speculative) == reference
    for method in ("autoregressive", "specexec", "specinfer", "rrs"):
        deltas = run(engine, Request(method, PROMPTS[1], greedy(), method=method))
        assert tokens(deltas) == reference, method
    auto = run(engine, Request("auto", PROMPTS[1], greedy(), method="autoregressive"))
    assert all(d.stats.tree_size == 1 and d.stats.num_accepted == 0 and len(d.token_ids) == 1 for d in auto)
    assert auto[-1].totals.target_passes == NUM_TOKENS > speculative[-1].totals.target_passes
    assert speculative[-1].totals.accepted_tokens > 0


@pytest.mark.parametrize("seed", [1, 29])
def test_seeded_autoregressive_equals_the_speculative_text(engine: Engine, seed: int) -> None:
    """Sample-and-match draws each position's token from noise keyed by (seed, position): without a
    tree, the same draws."""
    speculative = tokens(run(engine, Request("spec", PROMPTS[0], seeded(seed))))
    auto = tokens(run(engine, Request("auto", PROMPTS[0], seeded(seed), method="autoregressive")))
    assert auto == speculative


def test_autoregressive_beside_a_speculative_request(engine: Engine) -> None:
    """Both in one batch: each output is its own alone; the speculative one gets the whole budget."""
    alone = tokens(run(engine, Request("alone", PROMPTS[0], greedy())))
    engine.add_request(Request("auto", PROMPTS[1], greedy(), method="autoregressive"))
    engine.add_request(Request("spec", PROMPTS[0], greedy()))
    deltas: dict[str, list[TokenDelta]] = {"auto": [], "spec": []}
    while engine.num_running:
        output = engine.step()
        assert not output.failures
        for delta in output.deltas:
            deltas[delta.request_id].append(delta)
    assert tokens(deltas["spec"]) == alone
    assert len(tokens(deltas["auto"])) == NUM_TOKENS
    assert all(d.stats.tree_size == 1 for d in deltas["auto"])
    assert max(d.stats.tree_size for d in deltas["spec"]) == BUDGET + 1  # no share went to the other
    assert deltas["spec"][0].stats.batch_size == 2


def test_an_engine_without_a_draft_refuses_other_methods(pair) -> None:
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(method="autoregressive"),
        limits=LimitsConfig(max_context=128),
    ))
    assert engine.pair.draft is None
    with pytest.raises(ValueError, match="needs a draft"):
        engine.add_request(Request("x", PROMPTS[0], greedy(), method="specexec"))
    assert engine.num_running == 0
    assert len(tokens(run(engine, Request("y", PROMPTS[0], greedy(), method="autoregressive")))) == NUM_TOKENS
