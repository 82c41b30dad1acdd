"""How much of a joining prompt a step's target pass may carry: target pass seconds against the tokens
in the pass, fitted over recent passes as seconds = fixed + per_token x tokens.

A pass with n tree tokens costs fixed + per_token x n; a prompt slice of s tokens adds per_token x s.
It costs at most as much as the pass it rides on while s <= n + fixed / per_token, so running requests'
steps at most double while a long prompt fills in slices. A streamed target's pass is mostly fixed cost
(the weights' copy), so its slices are large; a resident one's are about its trees' size. Before the fit
is known (fixed / per_token taken as 0) the bound is the trees' own size, which is always safe.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # recent passes fitted
MIN_SLICE = 16  # prompt tokens a slice carries at least
SLICE_SHARE = 0.75  # of the bound: a margin for noise in the fit
MIN_SPREAD = 1.5  # largest / smallest token count among the samples before a fit is trusted


class PassTimes:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens in the pass, seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def fixed_per_token_ratio(self) -> float:
        """fixed / per_token of the least-squares line through the samples; 0 when it is not known
        (too few samples, too little spread in their sizes, or a line that is not increasing)."""
        if len(self.samples) < 3:
            return 0.0
        tokens = np.array([n for n, _ in self.samples], dtype=np.float64)
        seconds = np.array([s for _, s in self.samples])
        if tokens.max() < MIN_SPREAD * tokens.min():
            return 0.0
        per_token, fixed = np.polyfit(tokens, seconds, 1)
        return float(fixed / per_token) if per_token > 0 and fixed > 0 else 0.0

    def slice_tokens(self, tree_tokens: int) -> int:
        """Prompt tokens a pass that scores `tree_tokens` tree nodes may also carry."""
        return max(MIN_SLICE, int(SLICE_SHARE * (tree_tokens + self.fixed_per_token_ratio())))
