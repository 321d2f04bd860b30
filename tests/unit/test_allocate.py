"""The auto recipe's allocation: ladders by row length, the hull, and the greedy within a budget."""

from __future__ import annotations

import itertools

import pytest

from pipeline.core.errors import InputError
from pipeline.ternary.allocate import Rung, allocate, hull, ladder
from pipeline.ternary.policy import get_recipe, importance_for


def test_ladders_follow_the_block_sizes() -> None:
    assert [t for t, _ in ladder(2048, True)] == ["Q2_0", "Q2_0", "Q4_K", "Q6_K", "Q8_0"]
    assert ladder(640, True) == [("Q2_0", 3), ("Q2_0", 4), ("Q4_0", None), ("Q5_0", None), ("Q8_0", None)]
    assert ladder(640, False) == [("Q4_0", None), ("Q5_0", None), ("Q8_0", None)], "no ternary lookup tables"
    assert ladder(100, True) == []


def test_hull_skips_rungs_that_buy_too_little() -> None:
    rungs = [
        Rung("Q2_0", 3, 100, 10.0),
        Rung("Q2_0", 4, 100, 9.0),
        Rung("Q4_K", None, 200, 8.9),
        Rung("Q6_K", None, 300, 1.0),
        Rung("Q8_0", None, 400, 0.9),
    ]
    # Equal bytes: the better 4-level fit wins; Q4_K is above the line to Q6_K.
    assert hull(rungs) == [1, 3, 4]


def _brute_force(candidates: dict[str, list[Rung]], budget: int) -> float:
    names = list(candidates)
    best = float("inf")
    for pick in itertools.product(*(range(len(candidates[n])) for n in names)):
        spent = sum(candidates[n][i].n_bytes for n, i in zip(names, pick, strict=True))
        if spent <= budget:
            best = min(best, sum(candidates[n][i].cost for n, i in zip(names, pick, strict=True)))
    return best


def test_greedy_stays_in_budget_and_is_close_to_the_best_split() -> None:
    candidates = {
        "sensitive": [Rung("Q2_0", 3, 100, 50.0), Rung("Q4_K", None, 200, 5.0), Rung("Q8_0", None, 400, 0.1)],
        "robust": [Rung("Q2_0", 3, 100, 2.0), Rung("Q4_K", None, 200, 1.0), Rung("Q8_0", None, 400, 0.5)],
        "middle": [Rung("Q2_0", 3, 100, 10.0), Rung("Q4_K", None, 200, 2.0), Rung("Q8_0", None, 400, 0.2)],
    }
    for budget in (300, 400, 500, 700, 900, 1200):
        chosen = allocate(candidates, budget)
        spent = sum(candidates[n][i].n_bytes for n, i in chosen.items())
        cost = sum(candidates[n][i].cost for n, i in chosen.items())
        assert spent <= budget
        assert cost <= _brute_force(candidates, budget) + 2.0, budget  # within one step of the optimum
    assert allocate(candidates, 500) == {"sensitive": 1, "robust": 0, "middle": 1}
    # Below the cheapest file: every tensor at its cheapest rung, reported by the caller.
    assert allocate(candidates, 10) == {"sensitive": 0, "robust": 0, "middle": 0}


def test_auto_recipe_options() -> None:
    assert get_recipe("auto", {"target_bpw": 3}).target_bpw == 3.0
    assert (
        importance_for("auto", {}) == "imatrix" and importance_for("auto", {"importance": "none"}) == "none"
    )
    assert importance_for("q2_0", {}) == "none"
    with pytest.raises(InputError, match="applies to recipe auto only"):
        get_recipe("q2_0", {"target_bpw": 3})
    with pytest.raises(InputError, match="expected a number from 1.5 to 8.5"):
        get_recipe("auto", {"target_bpw": 20})
    with pytest.raises(InputError, match="method=optimal"):
        get_recipe("auto", {"method": "gptq"})


def test_quality_target_options() -> None:
    searched = get_recipe("auto", {"min_top1": 0.6})
    assert searched.has_quality_target and searched.min_top1 == 0.6
    assert searched.target_bpw == 8.5, "with a quality target and no size, any size up to all Q8_0"
    assert get_recipe("auto", {"max_kl": 0.5, "target_bpw": 5}).target_bpw == 5.0  # a cap the user set
    assert not get_recipe("auto", {"target_bpw": 5}).has_quality_target
    with pytest.raises(InputError, match="applies to recipe auto only"):
        get_recipe("q2_0", {"min_top1": 0.6})
    with pytest.raises(InputError, match="above 0 and at most 1"):
        get_recipe("auto", {"min_top1": 60})
    with pytest.raises(InputError, match="nats above 0"):
        get_recipe("auto", {"max_kl": 0})
    with pytest.raises(InputError, match="nats above 0"):
        get_recipe("auto", {"max_kl": True})
