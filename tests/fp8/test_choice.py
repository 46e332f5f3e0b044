"""The exact per-layer format choice (``fp8._choice.choose``) against brute force, and its refusals."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_precision.fp8._choice import choose, choose_within


def _brute(options, budget):
    best = None
    for picks in itertools.product(*(range(len(layer)) for layer in options)):
        error = sum(layer[j][0] for layer, j in zip(options, picks, strict=True))
        value = sum(layer[j][1] for layer, j in zip(options, picks, strict=True))
        if math.isfinite(error) and error <= budget and (best is None or value > best):
            best = value
    return best


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_on_small_layer_counts(seed):
    rng = random.Random(seed)
    for _ in range(300):
        layers = rng.randint(1, 7)
        # option 0 is high precision (no error, no saving); values may be negative (a format slower than bf16)
        options = [[(0.0, 0.0)] + [(rng.choice([0.0, round(rng.random(), 2), math.inf]), round(rng.uniform(-1, 2), 2))
                                   for _ in range(rng.randint(0, 4))] for _ in range(layers)]
        budget = rng.choice([0.0, 0.3, rng.random() * 3, math.inf])
        picks = choose(options, budget)
        assert len(picks) == layers
        error = sum(layer[j][0] for layer, j in zip(options, picks, strict=True))
        value = sum(layer[j][1] for layer, j in zip(options, picks, strict=True))
        assert error <= budget and math.isfinite(error)
        assert value == pytest.approx(_brute(options, budget), abs=1e-9)


def test_a_budget_of_zero_keeps_only_errorless_options():
    options = [[(0.0, 0.0), (0.1, 5.0)], [(0.0, 0.0), (0.0, 1.0), (0.2, 3.0)]]
    assert choose(options, 0.0) == [0, 1]


def test_the_budget_moves_the_error_where_it_buys_most():
    # layer 0's format buys 3 for 0.5 of error, layer 1's 2 for 0.5: one fits
    options = [[(0.0, 0.0), (0.5, 3.0)], [(0.0, 0.0), (0.5, 2.0)]]
    assert choose(options, 0.6) == [1, 0]
    assert choose(options, 1.0) == [1, 1]


def test_ties_take_the_smaller_error():
    assert choose([[(0.0, 1.0), (0.3, 1.0)]], 1.0) == [0]
    assert choose([[(0.0, 1.0), (0.3, 1.0)]]) == [0]


def test_hundreds_of_layers_are_solved():
    rng = random.Random(0)
    options = [[(0.0, 0.0)] + [(rng.random() * 1e-3, rng.random() * 1e-4) for _ in range(4)] for _ in range(300)]
    picks = choose(options, 300 * 1e-3 * 0.3)
    assert sum(options[i][j][0] for i, j in enumerate(picks)) <= 300 * 1e-3 * 0.3


@pytest.mark.parametrize(("options", "budget", "match"), [
    ([[(0.0, 0.0)]], -1.0, "budget=-1.0"),
    ([[(0.0, 0.0)]], math.nan, "budget=nan"),
    ([[]], 1.0, "layer 0 has no option"),
    ([[(-0.1, 0.0)]], 1.0, "errors are >= 0"),
    ([[(0.1, math.nan)]], 1.0, "values finite"),
    ([[(0.5, 0.0)], [(0.6, 1.0)]], 1.0, "no choice fits the error budget 1: the least summed error is 1.1"),
    ([[(0.0, 0.0)], [(math.inf, 1.0)]], math.inf, "every option of layer 1 has an infinite error"),
])
def test_refusals_name_the_problem(options, budget, match):
    with pytest.raises(ValueError, match=match):
        choose(options, budget)


def test_a_hard_instance_past_the_state_cap_stays_within_budget_and_says_what_it_gave_up():
    """Savings proportional to errors (the knapsack's hard case): the frontier grows exponentially. Past
    ``max_states`` one state per cell of error is kept; the result never breaks the budget and is at least the
    optimum for the budget less what ``choose_within`` says it gave up."""
    rng = random.Random(3)
    options = []
    for _ in range(9):
        row = [(0.0, 0.0)]
        for _ in range(3):
            e = rng.random()
            row.append((e, e * rng.uniform(0.99, 1.01)))
        options.append(row)
    budget = 3.0
    picks, given_up = choose_within(options, budget, max_states=8)
    assert given_up > 0  # the cap was reached: the case this test is about
    error = sum(layer[j][0] for layer, j in zip(options, picks, strict=True))
    value = sum(layer[j][1] for layer, j in zip(options, picks, strict=True))
    assert error <= budget
    assert value >= _brute(options, budget - given_up) - 1e-9
    assert choose_within(options, budget)[1] == 0.0  # under the default cap this one is exact
    assert choose_within(options, budget)[0] == choose(options, budget)


def test_a_hard_instance_bucketed_at_every_layer_gives_up_under_one_percent_of_the_budget():
    """20 hard layers past a cap of 30 states: the cells dropped at each layer sum to 40% of the budget (at the
    default cap such sums reached 2.9-3.8% on 100 layers, where the docs said under 1%); the LP bound certifies under 1%,
    and the choice is at least the optimum for the budget less that (found exactly: no cap reached)."""
    rng = random.Random(38)
    options = [[(0.0, 0.0)] + [(e, e * rng.uniform(0.99, 1.01)) for e in (rng.random() for _ in range(3))]
               for _ in range(20)]
    budget = 0.3 * sum(max(e for e, _ in layer) for layer in options)
    picks, given_up = choose_within(options, budget, max_states=30)
    assert 0 < given_up <= 0.01 * budget
    assert sum(layer[j][0] for layer, j in zip(options, picks, strict=True)) <= budget
    exact, exact_given_up = choose_within(options, budget - given_up, max_states=10**7)
    assert exact_given_up == 0.0
    value = sum(layer[j][1] for layer, j in zip(options, picks, strict=True))
    assert value >= sum(layer[j][1] for layer, j in zip(options, exact, strict=True)) - 1e-9
