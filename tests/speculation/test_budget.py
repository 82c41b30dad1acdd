"""--budget auto: the estimator and the chooser on synthetic curves where the best budget is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.speculation.budget import (
    BudgetTracker,
    acceptance_curve,
    accepted_at,
    budget_grid,
    calibration_budgets,
    choose_budget,
    interpolate,
    node_indicator,
)
from tests.helpers.tiny_models import make_tiny_pair

GRID = [16, 32, 64, 128, 256, 512, 1024]


def curve_from(fn, max_budget: int = 1024) -> np.ndarray:
    """A curve indexed by budget: curve[b] = fn(b), curve[0] = 0."""
    return np.array([0.0] + [fn(b) for b in range(1, max_budget + 1)])


def test_grid_and_calibration_points():
    assert budget_grid(1024, 16) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert budget_grid(100, 16)[-1] == 100
    assert calibration_budgets(GRID) == [16, 64, 256, 1024]
    assert calibration_budgets([8, 32]) == [8, 32]


def test_acceptance_curve_is_cumulative_path_probability_in_score_order():
    probs = torch.tensor([1.0, 0.9, 0.5, 0.45, 0.1])  # root, then nodes by falling draft score
    torch.testing.assert_close(acceptance_curve(probs), torch.tensor([0.9, 1.4, 1.85, 1.95]))
    path = torch.tensor([0, 1, 3])
    torch.testing.assert_close(acceptance_curve(node_indicator(5, path)), torch.tensor([1.0, 1.0, 2.0, 2.0]))


def test_interpolate():
    points = {16: 1.0, 64: 2.0, 256: 4.0}
    assert interpolate(points, 8) == 1.0
    assert interpolate(points, 40) == pytest.approx(1.5)
    assert interpolate(points, 512) == pytest.approx(4.0 + 2.0 / 192 * 256)
    assert interpolate({32: 3.0}, 1024) == 3.0
    assert interpolate({16: 2.0, 64: 1.0}, 128) == 1.0  # never extrapolates downwards


def test_accepted_at_uses_best_known_value_at_or_below():
    curve = np.full(9, np.nan)
    curve[:4] = [0.0, 0.5, 0.9, 1.2]
    assert accepted_at(curve, 2) == pytest.approx(0.9)
    assert accepted_at(curve, 8) == pytest.approx(1.2)  # unseen budgets gain nothing


def test_streamed_regime_flat_pass_cost_picks_the_knee():
    """Offloaded: a step costs 1 s up to 256 tokens, then grows linearly; acceptance grows like log2(b).
    rate(256) = 11 / 1; rate(512) = 13 / 2: the knee wins."""
    seconds = {b: 1.0 if b <= 256 else b / 256 for b in GRID}
    choice = choose_budget(GRID, curve_from(lambda b: 2 * math.log2(b / 8)), seconds)
    assert choice.budget == 256
    assert choice.rates[256] == pytest.approx(11.0)


def test_resident_regime_linear_cost_picks_where_acceptance_saturates():
    """Resident: cost grows with every token; acceptance saturates at 32 nodes."""
    seconds = {b: 0.05 + 0.001 * b for b in GRID}
    choice = choose_budget(GRID, curve_from(lambda b: min(b, 32) / 8), seconds)
    assert choice.budget == 32


def test_no_acceptance_prefers_the_cheapest_budget():
    choice = choose_budget(GRID, curve_from(lambda b: 0.0), {b: 1.0 for b in GRID})
    assert choice.budget == 16  # ties go to the smaller budget


class Simulator:
    """A fake device: true step time and true acceptance curve, with multiplicative noise."""

    def __init__(self, seconds_fn, accepted_fn, seed: int = 0):
        self.seconds_fn = seconds_fn
        self.accepted_fn = accepted_fn
        self.rng = np.random.default_rng(seed)

    def step(self, tracker: BudgetTracker, key: float) -> int:
        budget = tracker.choose(key)
        noise = self.rng.normal(1.0, 0.05)
        step_s = self.seconds_fn(budget) * noise
        luck = self.rng.normal(1.0, 0.1)  # one draw per step: each step's curve is a monotone cumsum
        curve = [self.accepted_fn(b) * luck for b in range(1, budget + 1)]
        tracker.observe(key, budget + 1, (0.3 * step_s, 0.7 * step_s, step_s), curve)
        return budget

    def true_best(self, grid: list[int]) -> int:
        return max(grid, key=lambda b: (1 + self.accepted_fn(b)) / self.seconds_fn(b))


def calibrate(tracker: BudgetTracker, sim: Simulator) -> None:
    budgets = calibration_budgets(tracker.grid)
    tracker.force([budgets[0], *budgets])
    for _ in range(len(budgets) + 1):
        sim.step(tracker, key=0.0)


def test_tracker_calibrates_explores_then_converges():
    sim = Simulator(lambda b: 1.0 + max(0, b - 200) / 150, lambda b: 2.5 * math.log2(1 + b / 16))
    tracker = BudgetTracker(grid=budget_grid(1024, 16))
    calibrate(tracker, sim)
    assert tracker.calibrated and not tracker.choices  # calibration teaches timings, not acceptance
    assert tracker.choose(0.6) == 1024  # first step of a new temperature explores the whole curve
    tracker.observe(0.6, 1025, (0.5, 4.0, 4.5), [sim.accepted_fn(b) for b in range(1, 1025)])
    budgets = [sim.step(tracker, 0.6) for _ in range(40)]
    best = sim.true_best(tracker.grid)
    assert tracker.choices[0.6].budget == best
    assert sum(b == best for b in budgets[-16:]) >= 14  # probes aside, it runs at the best budget


def test_tracker_follows_a_change_in_acceptance():
    """The text gets more predictable: larger trees pay off; probes find it."""
    seconds = lambda b: 1.0 + b / 256  # noqa: E731
    tracker = BudgetTracker(grid=GRID, probe_every=4)
    poor = Simulator(seconds, lambda b: min(b, 16) / 16, seed=1)
    calibrate(tracker, poor)
    for _ in range(30):
        poor.step(tracker, 0.0)
    assert tracker.choices[0.0].budget == poor.true_best(GRID) == 16
    rich = Simulator(seconds, lambda b: 3 * math.log2(b), seed=2)
    for _ in range(150):
        rich.step(tracker, 0.0)
    assert tracker.choices[0.0].budget == rich.true_best(GRID)


def test_tracker_ignores_warmup_and_unfilled_trees():
    tracker = BudgetTracker(grid=GRID)
    tracker.force([16, 16, 1024])
    tracker.choose(0.0)
    tracker.observe(0.0, 17, (9.0, 9.0, 18.0), None)  # warm-up: discarded
    assert not tracker.calibrated
    tracker.choose(0.0)
    tracker.observe(0.0, 17, (0.1, 0.2, 0.3), None)
    tracker.choose(0.0)
    tracker.observe(0.0, 300, (0.1, 0.2, 0.3), None)  # 1024 asked, 299 grown: no timing
    assert tracker.step_seconds == {16: pytest.approx(0.3)}


def test_engine_budget_auto_greedy_equals_autoregressive(tmp_path):
    from engine.config import EngineConfig, ModelConfig, SpeculationConfig
    from engine.runtime import Engine, load_pair
    from engine.types import Request, SamplingParams

    target, draft = make_tiny_pair(tmp_path, draft="noisy")
    config = EngineConfig(
        model=ModelConfig(target=str(target), draft=str(draft)), speculation=SpeculationConfig(budget="auto")
    )
    engine = Engine(load_pair(config), config)
    engine.budget_tracker.grid = [4, 8, 16, 32]
    engine.calibrate_budget()
    assert engine.budget_tracker.calibrated
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sizes = []
    got = []
    for delta in engine.generate(Request("r", prompt, params)):
        got += delta.token_ids
        sizes.append(delta.stats.tree_size - 1)
    baseline = engine.with_speculation(SpeculationConfig(method="autoregressive"))
    assert got == baseline.generate_ids(prompt, params)
    assert sizes[0] == 32 and all(s <= 32 for s in sizes)
    assert 0.0 in engine.budget_tracker.choices
