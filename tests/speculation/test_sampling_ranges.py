"""Sampling parameters at the edges: a temperature below GREEDY_TEMPERATURE is greedy everywhere, and
a value whose processed logits would be NaN or infinite is refused, naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation.sampling import process_logits
from engine.types import GREEDY_TEMPERATURE, SamplingParams, SamplingParamsError
from tests.helpers.speculation import NAMED_TREES
from tests.helpers.tiny_models import make_tiny_pair

TINY_TEMPERATURES = [1e-45, 1e-39, 1e-38, 1e-20, GREEDY_TEMPERATURE / 2]


@pytest.mark.parametrize("temperature", [0.0, *TINY_TEMPERATURES])
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, repetition_penalty=1.3, frequency_penalty=0.5)
    assert params.greedy and params.acceptance_key == 0.0
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 30
    processed = process_logits(logits, params, torch.ones(5, 50), torch.zeros(50, dtype=torch.bool))
    assert torch.isfinite(processed).all()
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("ranges"), draft="noisy", seed=2)
    return Engine.load(EngineConfig(
        model=ModelConfig(target=str(target), draft=str(draft)),
        speculation=SpeculationConfig(budget=16),
        limits=LimitsConfig(max_context=128),
    ))


@pytest.mark.parametrize("method", ["specexec", "specinfer", "rrs"])
def test_the_engine_decodes_a_tiny_temperature_greedily(engine, method):
    engine = engine.with_speculation(SpeculationConfig(method=method, budget=16, specinfer_temperature=NAMED_TREES))
    prompt = [5, 6, 7, 8]
    greedy = engine.generate_ids(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for temperature in TINY_TEMPERATURES:
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=32, ignore_eos=True)
        assert engine.generate_ids(prompt, params) == greedy, temperature


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf), ("temperature", 1e6),
    ("top_p", 0.0), ("top_p", math.nan), ("min_p", math.nan), ("min_p", 1.5),
    ("repetition_penalty", 1e-40), ("repetition_penalty", 0.0), ("repetition_penalty", 1e3),
    ("repetition_penalty", math.nan), ("presence_penalty", 1e39), ("presence_penalty", math.nan),
    ("frequency_penalty", -2.5), ("frequency_penalty", math.inf),
])
def test_a_value_out_of_range_is_refused_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=f"^{field} must be in") as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError)


def test_logit_bias_values_must_be_finite_and_bounded():
    for value in (math.inf, -math.inf, math.nan, 101.0):
        with pytest.raises(SamplingParamsError, match="^logit_bias must be in"):
            SamplingParams(logit_bias={3: value})
    SamplingParams(logit_bias={3: -100.0, 4: 100.0})


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=GREEDY_TEMPERATURE, repetition_penalty=0.01, frequency_penalty=-2.0,
                   presence_penalty=-2.0, logit_bias={1: 100.0}),
    SamplingParams(temperature=100.0, repetition_penalty=100.0, frequency_penalty=2.0, presence_penalty=2.0,
                   logit_bias={1: -100.0}),
], ids=["low-edges", "high-edges"])
def test_the_edges_of_the_ranges_give_finite_distributions(params):
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 50
    counts = torch.randint(0, 30, (8, 64), generator=torch.Generator().manual_seed(2)).float()
    probs = process_logits(logits, params, counts, torch.ones(64, dtype=torch.bool)).softmax(-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(8))
