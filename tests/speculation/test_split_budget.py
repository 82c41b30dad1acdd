"""The shared tree budget: split by marginal expected accepted tokens, an even floor for exploration."""

from __future__ import annotations

import numpy as np

from engine.speculation.budget import split_budget


def curve(scale: float, seen: int, size: int = 129) -> np.ndarray:
    out = np.full(size, np.nan)
    out[0] = 0.0
    out[1 : seen + 1] = scale * np.log1p(np.arange(1, seen + 1))
    return out


def test_one_request_gets_the_whole_budget() -> None:
    assert split_budget([None], 64) == [64]
    assert split_budget([curve(1.0, 10)], 64) == [64]


def test_the_budget_is_always_spent_exactly() -> None:
    for total in (1, 2, 3, 7, 64, 1000):
        for count in (2, 3, 5):
            budgets = split_budget([curve(1.0 + i, 50) for i in range(count)], total)
            assert sum(budgets) == total and min(budgets) >= 0


def test_the_more_predictable_request_gets_more() -> None:
    easy, hard = curve(2.0, 64), curve(0.3, 64)
    a, b = split_budget([easy, hard], 64)
    assert a > b >= 64 // 4  # the floor: half the budget shared evenly


def test_unknown_curves_split_evenly() -> None:
    assert split_budget([None, None], 64) == [32, 32]
    budgets = split_budget([None, None, None], 60)
    assert sum(budgets) == 60 and max(budgets) - min(budgets) <= 1
