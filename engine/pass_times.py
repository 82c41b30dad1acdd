"""How much of a joining prompt a step's target pass may carry, from the passes seen so far.

A pass over n tokens costs T(n) = max(copy, fixed + per_token x n): a streamed pass is flat at its
layers' copy time until its compute catches up, then grows with the tokens; a resident one is the
line alone. A slice rides on a pass of `tree_tokens` tree nodes and may bring it to at most twice its
cost, so running streams' steps at most double while a long prompt fills in. The line is fitted
(least squares) to the passes clearly above the fastest one; the pass's own cost is taken no higher
than the evidence allows (the line there, or a pass seen over fewer tokens), so an error in it only
makes slices smaller. A total seen to cost within the bound is allowed too; with nothing known,
doubling the tokens is within twice the cost (T(2n) <= 2 T(n) while fixed >= 0).
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # recent passes fitted
MIN_SLICE = 16  # prompt tokens a slice carries at least
SLICE_SHARE = 0.75  # of the bound: a margin for noise in the fit
MIN_SAMPLES = 3  # passes seen before anything but doubling is trusted
ABOVE_FLOOR = 1.25  # a pass this many times the floor or more is on the compute line
MIN_SPREAD = 1.5  # largest / smallest token count on the line before it is fitted


class PassTimes:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens in the pass, seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_token) of the compute line, fitted to the passes clearly above the fastest one
        (on a streamed target those past the copy time); None when not known."""
        if len(self.samples) < MIN_SAMPLES:
            return None
        tokens = np.array([n for n, _ in self.samples], dtype=np.float64)
        seconds = np.array([s for _, s in self.samples])
        on_line = seconds >= ABOVE_FLOOR * seconds.min()
        line_tokens = tokens[on_line]
        if line_tokens.size < 2 or line_tokens.max() < MIN_SPREAD * line_tokens.min():
            return None
        per_token, fixed = np.polyfit(line_tokens, seconds[on_line], 1)
        return (float(fixed), float(per_token)) if per_token > 0 else None

    def cost_at_least(self, num_tokens: int) -> float:
        """A lower bound on a pass of `num_tokens`: the compute line there, and no less than any pass seen
        over fewer tokens (a pass never costs less for more tokens); 0 when nothing is known."""
        line = self.fit()
        smaller = [s for n, s in self.samples if n <= num_tokens]
        bounds = [min(smaller)] if smaller else []
        if line is not None:
            bounds.append(line[0] + line[1] * num_tokens)
        return max(bounds, default=0.0)

    def slice_tokens(self, tree_tokens: int) -> int:
        """Prompt tokens a pass that scores `tree_tokens` tree nodes may also carry: the most that keeps
        it within twice its cost, by the line, or by a pass seen to cost no more."""
        tree_tokens = max(tree_tokens, 1)
        budget = 2 * self.cost_at_least(tree_tokens)
        line = self.fit()
        if line is None:
            bound = tree_tokens  # doubling: within twice the cost of any max(floor, fixed >= 0 + line)
        else:
            bound = int((budget - line[0]) / line[1]) - tree_tokens
        seen = [n for n, s in self.samples if s <= budget]
        if seen and len(self.samples) >= MIN_SAMPLES:
            bound = max(bound, max(seen) - tree_tokens)
        return max(MIN_SLICE, int(SLICE_SHARE * bound))
