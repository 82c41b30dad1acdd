"""bench.families compares like with like: its hand-written baseline (the pre-issue-35 Llama layer step)
(and, `--baseline today`, that step over today's engine attention) and the generic path give the same
logits, resident and streamed, and its paired timing runs."""

from __future__ import annotations

import pytest

from bench.families import check_equal, measure_pairs, runner_pair
from tests.helpers.tiny_models import make_tiny_pair


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    target, _ = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="same", seed=3, layers=3)
    return str(target)


@pytest.mark.parametrize("baseline", ["old", "today"])
@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_the_two_paths_agree_and_are_timed(target, streamed, baseline):
    """Either baseline (the pre-issue-35 step, or the hand-written step over today's engine attention)."""
    pair = runner_pair(target, streamed, baseline=baseline)
    try:
        assert check_equal(pair) < 1e-5
        hand, generic, ratio = measure_pairs(pair, num_tokens=4, num_pairs=3)
        assert hand > 0 and generic > 0 and ratio > 0
    finally:
        if streamed:
            pair[1].layers.close()
