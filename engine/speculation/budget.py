"""`--budget auto`: choose the tree budget that maximises expected tokens per second.

    rate(b) = (1 + E[accepted](b)) / step_seconds(b)

E[accepted](b) comes from what verification already computes: with SpecExec's sample-and-match, the
expected accepted length of a tree is the sum over its nodes of the target's path probability, and
the top-b nodes by draft score are (up to search order) the tree a budget-b step would grow, closed
under ancestors. So one step at budget B gives the whole curve b = 1..B: a cumulative sum in score
order (node index order). At temperature 0 the target is deterministic, and the curve counts the
nodes whose whole path is the target's argmax.

step_seconds(b) is measured: a short calibration at load (a few real steps at fixed sizes), then an
exponential moving average of every step that ran at b. Unmeasured budgets are interpolated.

The pure functions are tested on synthetic curves; `BudgetTracker` is the small stateful part the
engine consults before each step and feeds after it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("engine.speculation.budget")

DEFAULT_MAX_BUDGET = 1024
DEFAULT_MIN_BUDGET = 16
CALIBRATION_POINTS = 4  # fixed-size steps timed at load (after one warm-up step)

AcceptanceKey = float  # the request's temperature (0.0 = greedy); curves differ by sampling regime


def largest_budget(budget: int | str) -> int:
    """A fixed --budget, or with --budget auto the largest the tracker may choose (what caches and plans are
    sized for)."""
    return budget if isinstance(budget, int) else BudgetTracker().max_budget


def budget_grid(max_budget: int = DEFAULT_MAX_BUDGET, min_budget: int = DEFAULT_MIN_BUDGET) -> list[int]:
    """Candidate budgets: powers of two and the 1.5x points between them, min..max (max included)."""
    grid: list[int] = []
    power = 1
    while power <= max_budget:
        for value in (power, power * 3 // 2):
            if min_budget <= value <= max_budget and value not in grid:
                grid.append(value)
        power *= 2
    if max_budget not in grid:
        grid.append(max_budget)
    return sorted(grid)


def calibration_budgets(grid: list[int], num_points: int = CALIBRATION_POINTS) -> list[int]:
    """About `num_points` grid budgets spread evenly in log scale, smallest and largest included."""
    if len(grid) <= num_points:
        return list(grid)
    picks = np.unique(np.round(np.linspace(0, len(grid) - 1, num_points)).astype(int))
    return [grid[i] for i in picks]


def node_indicator(num_nodes: int, path: torch.Tensor) -> torch.Tensor:
    """[n] float: 1 at the accepted path's nodes (greedy: the nodes whose whole path is the argmax)."""
    out = torch.zeros(num_nodes, device=path.device)
    out[path] = 1.0
    return out


def acceptance_curve(path_probs: torch.Tensor) -> torch.Tensor:
    """path_probs: [n] per node in draft-score order, root first. Returns [n - 1]: entry b - 1 is
    E[accepted draft tokens] of the tree made of the root and the b best nodes."""
    return path_probs[1:].cumsum(dim=0)


def interpolate_all(points: dict[int, float], budgets: list[int]) -> np.ndarray:
    """Piecewise linear in the budget through measured points; flat below the smallest, and above
    the largest extended along the last segment (never decreasing)."""
    assert points, "no measured points"
    xs = np.array(sorted(points), dtype=np.float64)
    ys = np.array([points[int(x)] for x in xs])
    at = np.asarray(budgets, dtype=np.float64)
    out = np.interp(at, xs, ys)
    if xs.size > 1:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        above = at > xs[-1]
        out[above] = ys[-1] + slope * (at[above] - xs[-1])
    return out


def interpolate(points: dict[int, float], budget: int) -> float:
    return float(interpolate_all(points, [budget])[0])


def best_known(curve: np.ndarray) -> np.ndarray:
    """[len(curve)]: E[accepted] per budget from a curve indexed by budget (curve[0] == 0, NaN where
    never seen): the best known value at or below each budget (a bigger tree never accepts less)."""
    return np.maximum.accumulate(np.nan_to_num(curve, nan=0.0))  # expected counts are >= 0


def accepted_at(curve: np.ndarray, budget: int) -> float:
    return float(best_known(curve[: budget + 1])[-1])


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    rates: dict[int, float]  # budget -> expected tokens per second
    accepted: dict[int, float]  # budget -> E[accepted draft tokens per step]
    step_seconds: dict[int, float]  # budget -> estimated seconds per step


def choose_budget(grid: list[int], curve: np.ndarray, step_seconds: dict[int, float]) -> BudgetChoice:
    """The grid budget with the highest (1 + E[accepted](b)) / step_seconds(b); ties go to the smaller."""
    best = best_known(curve)
    accepted = {b: float(best[b]) for b in grid}
    seconds = {b: max(float(s), 1e-9) for b, s in zip(grid, interpolate_all(step_seconds, grid), strict=True)}
    rates = {b: (1.0 + accepted[b]) / seconds[b] for b in grid}
    best = max(grid, key=lambda b: (rates[b], -b))
    return BudgetChoice(best, rates, accepted, seconds)


def ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None or math.isnan(old) else (1.0 - alpha) * old + alpha * new


@dataclass
class BudgetTracker:
    """Picks each step's budget and learns from it. One per Engine; shared by its requests.

    Policy per acceptance key (temperature): the first step explores at the largest budget (the
    whole curve in one step); then the best budget, except every `probe_every`-th step, which
    probes the grid neighbour above (then below) the best, so the curve and timings there stay fresh.
    Timings only count when the tree filled its budget (end-of-request trees are smaller)."""

    grid: list[int] = field(default_factory=budget_grid)
    acceptance_alpha: float = 0.1
    timing_alpha: float = 0.3
    probe_every: int = 8
    curves: dict[AcceptanceKey, np.ndarray] = field(default_factory=dict)  # [max_budget + 1], NaN unseen
    step_seconds: dict[int, float] = field(default_factory=dict)  # budget -> EMA seconds per step
    draft_seconds: dict[int, float] = field(default_factory=dict)
    target_seconds: dict[int, float] = field(default_factory=dict)
    choices: dict[AcceptanceKey, BudgetChoice] = field(default_factory=dict)
    num_steps: int = 0
    _forced: list[tuple[int, bool]] = field(default_factory=list)  # (budget, discard) calibration queue
    _current: tuple[int, bool, bool] = (0, False, False)  # (budget, forced, discard) of the running step
    _since_probe: dict[AcceptanceKey, int] = field(default_factory=dict)
    _stamps: dict[AcceptanceKey, np.ndarray] = field(default_factory=dict)
    _curve_steps: dict[AcceptanceKey, int] = field(default_factory=dict)

    @property
    def max_budget(self) -> int:
        return self.grid[-1]

    @property
    def calibrated(self) -> bool:
        return bool(self.step_seconds)

    def force(self, budgets: list[int], warmup: int = 1) -> None:
        """Run the next steps at these budgets; the first `warmup` are timed but discarded."""
        self._forced = [(b, i < warmup) for i, b in enumerate(budgets)]

    def choose(self, key: AcceptanceKey) -> int:
        if self._forced:
            budget, discard = self._forced.pop(0)
            self._current = (budget, True, discard)
            return budget
        budget = self._policy(key)
        self._current = (budget, False, False)
        return budget

    def _policy(self, key: AcceptanceKey) -> int:
        choice = self.choices.get(key)
        if choice is None or not self.calibrated:
            return self.max_budget
        since = self._since_probe.get(key, 0) + 1
        self._since_probe[key] = since
        if since % self.probe_every == 0:  # probes alternate: the neighbour above, then below
            idx = self.grid.index(choice.budget)
            step = 1 if (since // self.probe_every) % 2 else -1
            return self.grid[min(max(idx + step, 0), len(self.grid) - 1)]
        return choice.budget

    def observe(
        self, key: AcceptanceKey, tree_size: int, step: tuple[float, float, float], curve: list[float] | None
    ) -> None:
        """After a step at the budget `choose` returned. step: (draft, target, whole step) seconds;
        curve: E[accepted] for budgets 1..tree_size - 1 (acceptance_curve)."""
        budget, forced, discard = self._current
        if discard:
            return
        self.num_steps += 1
        if tree_size - 1 >= budget:  # timings only from full trees
            draft_s, target_s, step_s = step
            self.draft_seconds[budget] = ema(self.draft_seconds.get(budget), draft_s, self.timing_alpha)
            self.target_seconds[budget] = ema(self.target_seconds.get(budget), target_s, self.timing_alpha)
            self.step_seconds[budget] = ema(self.step_seconds.get(budget), step_s, self.timing_alpha)
        if curve and not forced:  # the calibration prompt says nothing about real requests' acceptance
            self._update_curve(key, np.asarray(curve[:budget], dtype=np.float64))
        self._rechoose()

    def observe_curve(self, key: AcceptanceKey, curve: list[float] | None) -> None:
        """After a step shared with other requests: its acceptance only (its times belong to no one
        budget)."""
        _budget, forced, discard = self._current
        if discard or forced or not curve:
            return
        self._update_curve(key, np.asarray(curve[: self.max_budget], dtype=np.float64))
        self._rechoose()

    def _update_curve(self, key: AcceptanceKey, values: np.ndarray) -> None:
        """EMA per budget, with the decay counted in steps of this key: an entry last seen k steps
        ago (a probed budget) moves by 1 - (1 - alpha)^k, as if it had been seen every step."""
        if key not in self.curves:
            self.curves[key] = np.full(self.max_budget + 1, np.nan)
            self.curves[key][0] = 0.0
            self._stamps[key] = np.zeros(self.max_budget + 1, dtype=np.int64)  # step each entry was last seen
        now = self._curve_steps[key] = self._curve_steps.get(key, 0) + 1
        seen = self.curves[key][1 : values.shape[0] + 1]  # views: updated in place
        stamps = self._stamps[key][1 : values.shape[0] + 1]
        alpha = 1.0 - (1.0 - self.acceptance_alpha) ** (now - stamps)
        seen[:] = np.where(np.isnan(seen), values, (1.0 - alpha) * seen + alpha * values)
        stamps[:] = now

    def _rechoose(self) -> None:
        if not self.step_seconds:
            return
        for key, curve in self.curves.items():
            choice = choose_budget(self.grid, curve, self.step_seconds)
            previous = self.choices.get(key)
            self.choices[key] = choice
            if previous is None or previous.budget != choice.budget:
                log.info(
                    "budget auto: temperature %g -> budget %d "
                    "(E[accepted] %.2f, %.3f s/step, %.2f tokens/s expected)",
                    key,
                    choice.budget,
                    choice.accepted[choice.budget],
                    choice.step_seconds[choice.budget],
                    choice.rates[choice.budget],
                )

    def snapshot(self) -> dict[str, object]:
        """Plain data for the benchmark JSON."""
        return {
            "grid": list(self.grid),
            "choices": {str(k): c.budget for k, c in self.choices.items()},
            "expected_tokens_per_s": {str(k): c.rates[c.budget] for k, c in self.choices.items()},
            "step_seconds": dict(sorted(self.step_seconds.items())),
            "draft_seconds": dict(sorted(self.draft_seconds.items())),
            "target_seconds": dict(sorted(self.target_seconds.items())),
            "observed_steps": self.num_steps,
        }


def split_budget(curves: list[np.ndarray | None], total: int, quantum: int | None = None) -> list[int]:
    """Share `total` tree nodes among running sequences by marginal expected accepted tokens.

    curves[i]: [m_i + 1] E[accepted] of sequence i's tree at budgets 0..m_i (NaN where never seen), or
    None when unknown (it gets what an average known curve would). Every sequence first gets an even
    floor of half the total (so each keeps exploring), then quanta go one by one to the largest gain
    f_i(b_i + quantum) - f_i(b_i), curves read through `best_known` and extended past their end along
    their last segment (interpolate_all). Concave curves make this greedy split optimal. Returns budgets
    summing to `total` (a single sequence gets all of it)."""
    count = len(curves)
    if count == 1:
        return [total]
    floor = max(1, total // (2 * count)) if total >= count else 0
    budgets = [floor] * count
    left = total - floor * count
    quantum = quantum or max(1, total // 64)
    grid = np.arange(total + quantum + 1)
    known = [c for c in curves if c is not None and np.isfinite(c[1:]).any()]
    fallback = (
        np.mean([extend_curve(c, grid) for c in known], axis=0) if known else np.log1p(grid.astype(np.float64))
    )
    values = [fallback if c is None or not np.isfinite(c[1:]).any() else extend_curve(c, grid) for c in curves]
    while left > 0:
        step = min(quantum, left)
        gains = [values[i][budgets[i] + step] - values[i][budgets[i]] for i in range(count)]
        best = max(range(count), key=lambda i: (gains[i], -budgets[i]))
        budgets[best] += step
        left -= step
    return budgets


def extend_curve(curve: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """E[accepted] at `budgets` from a partly seen curve: best known values at the seen budgets,
    linear between them and along the last segment past them."""
    best = best_known(curve)
    seen = {int(b): float(best[b]) for b in np.flatnonzero(np.isfinite(curve))}
    seen.setdefault(0, 0.0)
    return interpolate_all(seen, budgets.tolist())
