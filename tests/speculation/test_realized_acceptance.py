"""Realized acceptance in the real decoding loop matches its trees' exact expectation.

For a sample-and-match tree, E[accepted draft tokens | tree] is the sum over non-root nodes of the
target's probability of the node's path (StepStats.expected_accepted). Given the tree, realized
minus expected has mean zero whatever came before (a martingale difference), so over many steps
the mean difference divided by its standard error is close to N(0, 1). Built-in pair, budget 256,
T 0.6 and 1.0, the engine's own step loop; the same for RRS trees (expectation under recursive
rejection sampling) at T 1.0; a verifier that draws from a sharper distribution than the one it
scores fails the same test. `specexec bench` prints both figures for longer runs.
"""

from __future__ import annotations

import math

import pytest
import torch

import engine.speculation.verify as verify
from engine.cli import DEFAULT_MODELS
from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.speculation import NAMED_TREES

pytestmark = pytest.mark.slow

BUDGET = 256
STEPS = 120  # per temperature; the difference's sd is ~2 tokens here, so the standard error is ~0.2
PROMPTS = ["import os\n\n\ndef ", "class Parser:\n    def __init__(self", "    for key, value in ",
           "def test_split(self):\n    ", "with open(path) as f:\n    ", "raise ValueError("]
Z_LIMIT = 4.0


def load(method: str) -> Engine:
    if not (DEFAULT_MODELS / "target").is_dir():
        pytest.skip("models/default is missing")
    return Engine.load(EngineConfig(
        model=ModelConfig(target=str(DEFAULT_MODELS / "target"), draft=str(DEFAULT_MODELS / "draft")),
        speculation=SpeculationConfig(method=method, budget=BUDGET, specinfer_temperature=NAMED_TREES),
        limits=LimitsConfig(max_context=512, max_running=1),
    ))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load("specexec")


def realized_and_expected(engine: Engine, temperature: float, steps: int) -> tuple[list[int], list[float]]:
    """(accepted, expected accepted) per step, from seeded requests run until `steps` steps."""
    realized: list[int] = []
    expected: list[float] = []
    seed = 0
    while len(realized) < steps:
        prompt = engine.tokenizer.encode(PROMPTS[seed % len(PROMPTS)])
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=64, ignore_eos=True)
        for delta in engine.generate(Request(f"r{seed}", prompt, params)):
            assert delta.stats is not None and delta.stats.expected_accepted is not None
            realized.append(delta.stats.num_accepted)
            expected.append(delta.stats.expected_accepted)
        seed += 1
    return realized, expected


def z_score(realized: list[int], expected: list[float]) -> float:
    """Mean of realized - expected over its standard error."""
    diffs = [r - e for r, e in zip(realized, expected, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean / math.sqrt(var / len(diffs))


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_realized_acceptance_matches_the_trees_expectation(engine, temperature) -> None:
    realized, expected = realized_and_expected(engine, temperature, STEPS)
    z = z_score(realized, expected)
    assert abs(z) < Z_LIMIT, (z, sum(realized) / len(realized), sum(expected) / len(expected))
    assert sum(expected) / len(expected) > 1.0  # trees deep enough for the test to mean something


def test_rrs_realized_acceptance_matches_the_trees_expectation() -> None:
    """RRS trees, shaped from the shape book (each request after the first starts from the ones
    before it): their exact expectation under recursive rejection sampling, against what verification
    accepts."""
    realized, expected = realized_and_expected(load("rrs"), 1.0, STEPS)
    z = z_score(realized, expected)
    assert abs(z) < Z_LIMIT, (z, sum(realized) / len(realized), sum(expected) / len(expected))
    assert sum(expected) / len(expected) > 1.0


def test_a_verifier_drawing_from_the_wrong_distribution_fails_it(engine, monkeypatch) -> None:
    """Draws from logits x 2 (half the temperature) while node probabilities come from the real ones."""
    original = verify.sample_tokens

    def sharper(block: torch.Tensor, greedy: bool, generator: torch.Generator, noise=None) -> torch.Tensor:
        return original(block * 2.0, greedy, generator, noise)

    monkeypatch.setattr(verify, "sample_tokens", sharper)
    realized, expected = realized_and_expected(engine, 0.6, STEPS)
    assert abs(z_score(realized, expected)) > Z_LIMIT
