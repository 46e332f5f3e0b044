"""The exact choice of one format per layer: the most value (predicted saving) whose summed error stays within a
budget. A multiple-choice knapsack, solved exactly by dynamic programming over the Pareto frontier of (error, value)
pairs: after each layer only the partial choices that no other beats on both error and value are kept, and those
whose best completion (the LP relaxation's bound) cannot reach a choice already known, so the optimum is never
pruned, whatever the errors (real numbers: no grid, no rounding). No solver dependency.

The knapsack is NP-hard: inputs exist (values proportional to errors) whose frontier grows exponentially. So that a
plan never stalls a run, a frontier past ``MAX_STATES`` keeps one state per ``budget / MAX_STATES`` of error (the one
of most value: true errors are kept, so the budget still holds); ``choose_within`` says how much budget that may have
cost (``slack``: the result is at least the optimum for ``budget - slack``): the smaller of the cells dropped, summed
over the layers bucketed (0.3-2.9% of the budget on 30 to 500 layers whose savings track their errors within 1%,
3.8% in issue 38's probe), and the least ``slack`` for which the LP bound falls to the result's value (under 0.05% of
the budget on such inputs; tests/fp8/test_choice.py). Real models' measured numbers stay far below the cap; the plan
warns when it happens.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_STATES", "Option", "choose", "choose_within"]

MAX_STATES = 2000

Option = tuple[float, float]  # (error, value) of one format for one layer


def choose(options: Sequence[Sequence[Option]], budget: float = math.inf) -> list[int]:
    """``choose_within``'s picks, without its slack."""
    return choose_within(options, budget)[0]


def choose_within(options: Sequence[Sequence[Option]], budget: float = math.inf,
                  max_states: int = MAX_STATES) -> tuple[list[int], float]:
    """Per layer, the index of the option chosen: the choice with the largest summed value whose summed error is at
    most ``budget``; among equal values the smaller error, then the earlier options. An option of error inf never
    fits, whatever the budget. Every layer needs an option (in a plan, its high precision: error 0, value 0), and some
    choice must fit the budget.

    Example:
        Two layers, each with high precision (0, 0) and two formats; a budget of 1.0 fits one aggressive format:

        >>> choose_within([[(0, 0), (0.2, 1.0), (0.9, 3.0)], [(0, 0), (0.2, 1.0), (0.9, 2.5)]], budget=1.0)
        ([2, 0], 0.0)

    The second element is the budget the choice may have given up to stay within ``max_states`` (module docstring):
    0.0 when exact.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or math.isnan(budget) or budget < 0:
        raise ValueError(f"choose(budget={budget!r}): a number >= 0 (inf: no budget).")
    for i, layer in enumerate(options):
        if not layer:
            raise ValueError(f"choose: layer {i} has no option.")
        for error, value in layer:
            if not (error >= 0 and math.isfinite(value)):
                raise ValueError(f"choose: layer {i} has an option of error {error!r} and value {value!r}; errors are"
                                 " >= 0 (inf: never fits) and values finite.")
    if math.isinf(budget):  # no coupling between layers: each takes its best (an error of inf never fits)
        best_each: list[int] = []
        for i, layer in enumerate(options):
            fits = [j for j, (error, _) in enumerate(layer) if math.isfinite(error)]
            if not fits:
                raise ValueError(f"choose: no choice fits: every option of layer {i} has an infinite error.")
            best_each.append(max(fits, key=lambda j: (layer[j][1], -layer[j][0], -j)))  # noqa: B023 (used at once)
        return best_each, 0.0
    bound = _SuffixBound(options)
    greedy = bound.greedy(budget)  # a real choice: states that cannot beat its total are dropped
    if greedy is None:
        least = sum(min(error for error, _ in layer) for layer in options)
        raise ValueError(f"choose: no choice fits the error budget {budget:g}: the least summed error is {least:g}.")
    incumbent, fallback = greedy
    slack = 1e-12 * (1.0 + abs(incumbent))  # keep states that tie with the incumbent, rounding aside
    # frontier: (error, value, link); link = (option, previous link) spells the choice back to the first layer
    frontier: list[tuple[float, float, Any]] = [(0.0, 0.0, None)]
    cell, given_up = budget / max_states, 0.0
    for i, layer in enumerate(options):
        grown = [(e + error, v + value, (j, link)) for e, v, link in frontier for j, (error, value) in enumerate(layer)
                 if e + error <= budget]
        # Pareto prune: by error ascending (value descending among equals), keep a state only if it beats every
        # cheaper one on value; then drop the states whose best completion (the LP bound) cannot reach the incumbent.
        grown.sort(key=lambda s: (s[0], -s[1]))
        frontier = []
        for state in grown:
            if (not frontier or state[1] > frontier[-1][1]) and \
                    state[1] + bound.upper(i + 1, budget - state[0]) >= incumbent - slack:
                frontier.append(state)
        if len(frontier) > max_states and cell > 0:
            # one state per cell of error: the frontier is sorted by error with values rising, so the last of each
            # cell has its most value; a dropped state had at most `cell` less error than the one kept
            kept = {int(state[0] / cell): state for state in frontier}
            frontier, given_up = sorted(kept.values(), key=lambda s: s[0]), given_up + cell
    best = max(frontier, key=lambda s: (s[1], -s[0]), default=None)
    if best is None or best[1] < incumbent:  # past MAX_STATES every chain kept fell short of the greedy choice
        picks, value = fallback, incumbent
    else:
        picks, link, value = [], best[2], best[1]
        while link is not None:
            j, link = link
            picks.append(j)
        picks.reverse()
    # The cells' sum bounds what was given up, but it grows with the layers bucketed (up to 3.8% of the budget in
    # issue 38's probe); the LP bound certifies far less (under 0.05% on 30 to 500 hard layers): take the smaller.
    return picks, min(given_up, bound.budget_reached(value, budget), budget) if given_up > 0 else 0.0


class _SuffixBound:
    """Bounds on what the layers from ``i`` on can add within a remaining budget: ``upper`` is the LP relaxation of
    the multiple-choice knapsack (each layer's options reduced to the upper concave hull of (error, value), increments
    taken by slope, the last one fractionally), never below the integer optimum; ``greedy`` a feasible total."""

    def __init__(self, options: Sequence[Sequence[Option]]) -> None:
        n = len(options)
        bases: list[Option] = []
        steps: list[list[Option]] = []  # per layer, the hull's increments (error, value), slopes decreasing
        self.hull_index: list[list[int]] = []  # per layer, the options on its hull, in order
        for layer in options:
            finite = sorted((e, -v, j) for j, (e, v) in enumerate(layer) if math.isfinite(e))
            hull: list[Option] = []
            index: list[int] = []
            for e, negative, j in finite:
                v = -negative
                if hull and v <= hull[-1][1]:
                    continue  # no more value for more error
                while len(hull) >= 2 and _slope(hull[-2], hull[-1]) <= _slope(hull[-1], (e, v)):
                    hull.pop()  # under the chord: never on the LP's path
                    index.pop()
                hull.append((e, v))
                index.append(j)
            bases.append(hull[0] if hull else (math.inf, 0.0))
            steps.append([(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(hull)])
            self.hull_index.append(index)
        # suffix sums of the bases, and the suffix's increments sorted by slope (cumulative error and value)
        self.base_error = [0.0] * (n + 1)
        self.base_value = [0.0] * (n + 1)
        self.cum_error: list[list[float]] = [[] for _ in range(n + 1)]
        self.cum_value: list[list[float]] = [[] for _ in range(n + 1)]
        merged: list[tuple[float, float, float]] = []  # (-slope, error, value)
        # every increment of every layer by slope, with its layer, for `greedy`: within a layer the slopes decrease,
        # so the order also respects each layer's own (and a sort's ties keep it: the layer's position comes next)
        self.first = sorted((-dv / de, i, de, dv) for i, layer in enumerate(steps) for de, dv in layer)
        for i in range(n - 1, -1, -1):
            self.base_error[i] = self.base_error[i + 1] + bases[i][0]
            self.base_value[i] = self.base_value[i + 1] + bases[i][1]
            for de, dv in steps[i]:
                bisect.insort(merged, (-dv / de if de > 0 else -math.inf, de, dv))
            self.cum_error[i] = list(itertools.accumulate(d[1] for d in merged))
            self.cum_value[i] = list(itertools.accumulate(d[2] for d in merged))

    def upper(self, i: int, budget: float) -> float:
        left = budget - self.base_error[i]
        if left < 0:
            return -math.inf
        errors, values = self.cum_error[i], self.cum_value[i]
        k = bisect.bisect_right(errors, left)  # increments taken whole
        value = self.base_value[i] + (values[k - 1] if k else 0.0)
        if k < len(errors):  # the next one, fractionally
            step_error = errors[k] - (errors[k - 1] if k else 0.0)
            step_value = values[k] - (values[k - 1] if k else 0.0)
            taken = left - (errors[k - 1] if k else 0.0)
            value += step_value * taken / step_error if step_error > 0 else step_value
        return value

    def budget_reached(self, value: float, budget: float) -> float:
        """The least ``slack`` such that ``value`` is at least the LP bound, hence the optimum, for ``budget - slack``
        (the bound rises with the budget: bisection, to 2**-50 of it)."""
        reached = lambda b: self.upper(0, b) <= value + 1e-12 * (1.0 + abs(value))  # noqa: E731  (rounding aside)
        low, high = 0.0, budget
        if reached(budget):
            return 0.0
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (low, middle) if reached(budget - middle) else (middle, high)
        return high

    def greedy(self, budget: float) -> tuple[float, list[int]] | None:
        """A real choice and its total, or None if none fits: the bases, then each layer's hull increments in slope
        order while they fit, passing over one that does not (and that layer's later ones) to try the rest."""
        left = budget - self.base_error[0]
        if left < 0:
            return None
        value = self.base_value[0]
        position = [0] * len(self.hull_index)
        blocked: set[int] = set()
        for _, layer, de, dv in self.first:
            if layer in blocked:
                continue
            if de <= left:
                left, value = left - de, value + dv
                position[layer] += 1
            else:
                blocked.add(layer)
        return value, [index[k] for index, k in zip(self.hull_index, position, strict=True)]


def _slope(a: Option, b: Option) -> float:
    return (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else math.inf
