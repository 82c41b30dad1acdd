"""The automatic prefill slice (engine.pass_times): a slice keeps its pass within twice the pass's cost
under the pass-time model of the hardware, streamed (flat at the copy time, then compute) or resident
(a line), and is never larger than the model allows."""

from __future__ import annotations

import pytest

from engine.pass_times import MIN_SLICE, SLICE_SHARE, PassTimes


def seen(cost, token_counts: list[int]) -> PassTimes:
    times = PassTimes()
    for n in token_counts:
        times.observe(n, cost(n))
    return times


def streamed(n: int) -> float:
    """A streamed pass on a GPU: 0.6 s of copying hides compute up to 3,000 tokens, then 0.2 ms each."""
    return max(0.6, 0.2e-3 * n)


def resident(n: int) -> float:
    """A resident pass: 20 ms plus 1 ms per token."""
    return 0.02 + 1e-3 * n


def test_with_nothing_seen_a_slice_doubles_the_tree() -> None:
    assert PassTimes().slice_tokens(257) == int(SLICE_SHARE * 257)
    assert PassTimes().slice_tokens(4) == MIN_SLICE


@pytest.mark.parametrize("cost", [streamed, resident])
def test_a_slice_keeps_the_pass_within_twice_its_cost(cost) -> None:
    times = seen(cost, [257, 257, 300, 1024, 1281, 257, 4096, 8000, 257])
    for tree in (1, 65, 257, 1025, 5000):
        total = tree + times.slice_tokens(tree)
        assert cost(total) <= 2 * cost(tree) * 1.001, (tree, total)


def test_a_streamed_pass_carries_the_prompt_its_copy_time_hides_within_a_few_steps() -> None:
    """Flat at 0.6 s up to 3,000 tokens, then 0.2 ms a token: twice 0.6 s is reached at 6,000 tokens.
    A stream's 257-node trees, then a prompt joining in slices: each flat pass doubles what the next
    may carry, so a 3,800-token prompt is in after five passes, and no pass costs more than twice a
    tree's (a line fitted through these passes would have a slope of noise)."""
    times, tree, written, passes = seen(streamed, [64, 257, 257]), 257, 0, 0
    while written < 3800:
        part = min(times.slice_tokens(tree), 3800 - written)
        assert streamed(tree + part) <= 2 * streamed(tree)
        times.observe(tree + part, streamed(tree + part))
        written, passes = written + part, passes + 1
    assert passes <= 5
    assert times.slice_tokens(tree) >= 2000  # what it learnt carries larger slices since (192 at first)


def test_a_resident_pass_allows_about_its_own_size_plus_its_fixed_cost() -> None:
    """20 ms + 1 ms a token: a 17-node pass (37 ms) may grow to 54 tokens (74 ms) with a slice; of
    the totals seen, 50 is the largest within that."""
    times = seen(resident, [17, 17, 50, 200, 17, 512])
    assert times.slice_tokens(17) == int(SLICE_SHARE * (50 - 17))


def test_one_slow_pass_does_not_make_slices_larger() -> None:
    """Noise: a pass of the tree's own size that ran slow never raises the bound (only passes seen to
    cost little do)."""
    times = seen(streamed, [257, 257, 514])
    before = times.slice_tokens(257)
    times.observe(257, 5.0)
    assert times.slice_tokens(257) == before
