"""How much of a joining prompt a step's target pass may carry, from the passes seen so far.

A pass over n tokens costs T(n) = max(copy, fixed + per_token x n) with fixed >= 0: a streamed pass is
flat at its layers' copy time until its compute catches up, then grows with the tokens; a resident one
is the line alone. A slice rides on a pass of `tree_tokens` tree nodes and may bring it to at most
twice its cost, so running streams' steps at most double while a long prompt fills in.

No parameter of T is fitted (on a streamed pass a fitted slope is noise). Two properties of every
such T are used instead: it never falls as tokens are added, and T(2n) <= 2 T(n). So a pass of
`tree_tokens` costs at least any pass seen over fewer tokens (cost_at_least), and a total is within
twice its cost if a pass of that total was seen to cost no more than twice it, or if half that total
was seen to cost no more than it. While the pass stays flat the allowed slice doubles with each pass
that carries one, so a long prompt on a streamed target fills in a few steps.
"""

from __future__ import annotations

from collections import deque

WINDOW = 64  # recent passes kept
MIN_SLICE = 16  # prompt tokens a slice carries at least
SLICE_SHARE = 0.75  # of the allowed prompt tokens: a margin for noise in the timings


class PassTimes:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens in the pass, seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def cost_at_least(self, num_tokens: int) -> float:
        """A lower bound on a pass of `num_tokens`: the cheapest pass seen over no more tokens (a pass
        never costs less for more tokens); 0 when none was seen."""
        return min((s for n, s in self.samples if n <= num_tokens), default=0.0)

    def slice_tokens(self, tree_tokens: int) -> int:
        """Prompt tokens a pass that scores `tree_tokens` tree nodes may also carry: the largest total
        known to stay within twice the pass's cost, less the tree."""
        tree_tokens = max(tree_tokens, 1)
        cost = self.cost_at_least(tree_tokens)
        total = 2 * tree_tokens  # T(2n) <= 2 T(n)
        for n, seconds in self.samples:
            if seconds <= cost:
                total = max(total, 2 * n)  # T(2n) <= 2 T(n) <= 2 T(tree)
            elif seconds <= 2 * cost:
                total = max(total, n)
        return max(MIN_SLICE, int(SLICE_SHARE * (total - tree_tokens)))
