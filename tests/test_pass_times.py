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


def test_before_three_passes_a_slice_doubles_the_tree() -> None:
    assert PassTimes().slice_tokens(257) == int(SLICE_SHARE * 257)
    assert seen(streamed, [257, 257]).slice_tokens(257) == int(SLICE_SHARE * 257)
    assert PassTimes().slice_tokens(4) == MIN_SLICE


@pytest.mark.parametrize("cost", [streamed, resident])
def test_a_slice_keeps_the_pass_within_twice_its_cost(cost) -> None:
    times = seen(cost, [257, 257, 300, 1024, 1281, 257, 4096, 8000, 257])
    for tree in (1, 65, 257, 1025):
        total = tree + times.slice_tokens(tree)
        assert cost(total) <= 2 * cost(tree) * 1.001, (tree, total)


def test_a_streamed_pass_carries_the_prompt_its_copy_time_hides() -> None:
    """Flat at 0.6 s up to 3,000 tokens, then 0.2 ms a token: twice 0.6 s is reached at 6,000 tokens,
    so a 257-node tree may carry about 6,000 - 257 prompt tokens (less the noise margin); a straight
    line through these passes (the old fit) would have given a slope of noise."""
    times = seen(streamed, [257, 257, 300, 1024, 1281, 257, 4096, 8000, 257])
    assert times.slice_tokens(257) == pytest.approx(SLICE_SHARE * (6000 - 257), abs=2)


def test_flat_passes_alone_allow_what_was_seen_at_the_floor() -> None:
    """Every pass seen took the copy time: a prompt as large as the largest of them rides for free."""
    times = seen(streamed, [257, 257, 2048, 257])
    assert times.slice_tokens(257) == int(SLICE_SHARE * (2048 - 257))
    assert times.slice_tokens(1500) == int(SLICE_SHARE * 1500)  # doubling is within twice any such cost


def test_a_resident_pass_allows_about_its_own_size_plus_its_fixed_cost() -> None:
    times = seen(resident, [16, 17, 64, 200, 17, 512])
    assert times.slice_tokens(17) == pytest.approx(int(SLICE_SHARE * (17 + 20)), abs=1)
