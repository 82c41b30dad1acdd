"""RRS growth's pieces against their plain definitions: the candidate order (score descending, ties
by creation) and a node's row (the top-w tokens once each, q renormalised over them, drawn tokens
before zero-q ones). That the draws follow q without replacement is checked in distribution by
test_rrs_exactness (chi-square, and a planted top-k growth that fails it)."""

from __future__ import annotations

import torch

from engine.speculation.rrs_growth import Candidates, draw_proposals
from engine.types import SamplingParams


def test_best_is_a_stable_sort_of_the_scores_with_ties() -> None:
    generator = torch.Generator().manual_seed(0)
    for size, count in ((1, 1), (5, 3), (300, 65), (2000, 257), (40, 40), (40, 100)):
        pool = Candidates.root(0, 0, torch.device("cpu"))
        # few distinct values: many ties, at the cut too
        pool.scores = torch.randint(-6, 1, (size,), generator=generator).float()
        want = torch.sort(pool.scores, descending=True, stable=True).indices[:count]
        assert torch.equal(pool.best(count), want)


def test_a_row_is_the_top_w_renormalised_with_drawn_tokens_first() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=generator) * 2
    logits[2, 10:] = float("-inf")  # a row with 10 allowed tokens: fewer than the draws
    ids, q, ranked = draw_proposals(logits, SamplingParams(temperature=1.0), 20, 12, generator)
    probs = logits.softmax(dim=-1)
    top = probs.topk(20, dim=-1)
    for row in range(3):
        assert sorted(ids[row].tolist()) == sorted(top.indices[row].tolist())  # the row: the top w, each once
        expected_q = probs[row, ids[row]] / top.values[row].sum()
        assert torch.allclose(q[row], expected_q, atol=1e-6)
        assert torch.allclose(ranked[row], top.values[row, :12] / top.values[row].sum(), atol=1e-6)
    assert (q[2, :10] > 0).all() and (q[2, 10:12] == 0).all()  # of the 12 draws, the 10 allowed come first
