"""bench.shape_replay's offline cuts: a cut keeps nodes whose parent and earlier siblings it keeps,
and the hindsight bound is the best such cut."""

from __future__ import annotations

import pytest
import torch

from bench.shape_replay import hindsight, picked_value, replay
from engine.types import SamplingParams

# root -> a (rank 0, reached 0.5), b (rank 1, 0.3); a -> c (rank 0, 0.45)
TREE = {"request": 0, "step": 0, "parents": torch.tensor([-1, 0, 0, 1]), "depths": torch.tensor([0, 1, 1, 2]),
        "ranks": torch.tensor([0, 0, 1, 0]), "pis": torch.tensor([1.0, 0.6, 0.3, 0.9]),
        "reach": torch.tensor([1.0, 0.5, 0.3, 0.45]), "accepted": torch.tensor([1.0, 0.5, 0.6, 0.9])}


def test_hindsight_is_the_best_closed_cut() -> None:
    assert hindsight(TREE, 2) == pytest.approx(0.95)  # a and c, not a and b
    assert hindsight(TREE, 1) == pytest.approx(0.5)
    assert hindsight(TREE, 3) == pytest.approx(1.25)


def test_a_cut_by_scores_counts_what_it_keeps() -> None:
    assert picked_value(TREE, torch.tensor([0.0, -0.5, -1.0, -0.7]), 2) == pytest.approx(0.95)
    assert picked_value(TREE, torch.tensor([0.0, -0.5, -0.6, -0.7]), 2) == pytest.approx(0.8)


def test_replay_never_beats_hindsight() -> None:
    trees = [dict(TREE, request=r, step=s) for r in range(3) for s in range(2)]
    results = replay(trees, 2, SamplingParams(temperature=1.0))
    assert set(results) == {"own", "book", "hindsight"}
    for name in ("own", "book"):
        assert all(v <= h + 1e-9 for (_, v), (_, h) in zip(results[name], results["hindsight"], strict=True))
