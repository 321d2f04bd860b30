"""The auto recipe's allocation: ladders by row length, the hull, the greedy within a budget, and nesting."""

from __future__ import annotations

import itertools
import random

import pytest

from pipeline.core.errors import InputError
from pipeline.ternary.allocate import Rung, allocate, hull, ladder, upgrades
from pipeline.ternary.policy import get_recipe, importance_for, reads_statistics


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


def test_sensitivity_option() -> None:
    measured = get_recipe("auto", {"sensitivity": "measured"})
    assert measured.reads_reference and not measured.has_quality_target and measured.target_bpw == 4.0
    assert reads_statistics("auto", {"sensitivity": "measured", "importance": "none"})
    # auto measures by default; without an imatrix its files cannot be scored, so it takes the proxy.
    assert get_recipe("auto", {}).sensitivity == "measured" and get_recipe("auto", {}).reads_reference
    assert get_recipe("auto", {"importance": "none"}).sensitivity == "proxy"
    assert not get_recipe("auto", {"importance": "none"}).reads_reference
    assert get_recipe("auto", {"sensitivity": "proxy", "max_kl": 0.5}).reads_reference
    assert get_recipe("q2_0", {"sensitivity": "proxy"}).sensitivity == "proxy"
    with pytest.raises(InputError, match="applies to recipe auto only"):
        get_recipe("q2_0", {"sensitivity": "measured"})
    with pytest.raises(InputError, match="expected one of proxy, measured"):
        get_recipe("auto", {"sensitivity": "kl"})


def _synthetic_model(seed: int, n_tensors: int = 40) -> dict[str, list[Rung]]:
    """Ladders of made-up tensors: sizes spanning three orders of magnitude (one huge embedding-like
    tensor among small ones), costs falling by a random factor per rung."""
    rng = random.Random(seed)
    model: dict[str, list[Rung]] = {}
    for i in range(n_tensors):
        params = rng.choice((4096, 65536, 1 << 20)) if i else 1 << 24
        cost = rng.uniform(1.0, 100.0)
        rungs = []
        for ggml_type, levels, bpw in (("Q2_0", 3, 2.25), ("Q2_0", 4, 2.25), ("Q4_K", None, 4.5),
                                       ("Q6_K", None, 6.5625), ("Q8_0", None, 8.5)):
            rungs.append(Rung(ggml_type, levels, int(params * bpw / 8), cost))
            cost *= rng.uniform(0.05, 1.1)  # sometimes a rung buys nothing: the hull skips it
        model[f"blk.{i}.w"] = rungs
    return model


@pytest.mark.parametrize("seed", range(5))
def test_more_budget_never_moves_a_tensor_down(seed: int) -> None:
    model = _synthetic_model(seed)
    lowest = sum(min(r.n_bytes for r in rungs) for rungs in model.values())
    highest = sum(max(r.n_bytes for r in rungs) for rungs in model.values())
    before = allocate(model, 0)
    for budget in range(lowest, highest + 2, max(1, (highest - lowest) // 400)):
        after = allocate(model, budget)
        spent = sum(model[name][index].n_bytes for name, index in after.items())
        assert spent <= budget
        for name, index in after.items():
            was, now = model[name][before[name]], model[name][index]
            assert now.n_bytes >= was.n_bytes and now.cost <= was.cost, (seed, budget, name)
        before = after
    assert all(model[n][i].cost == min(r.cost for r in model[n]) for n, i in before.items()), "all bought"


def test_upgrades_take_each_tensors_hull_bottom_up() -> None:
    model = _synthetic_model(7)
    steps = upgrades(model)
    for name, rungs in model.items():
        path = hull(rungs)
        assert [index for n, index in steps if n == name] == path[1:]


def test_a_giant_step_does_not_stand_in_the_way_of_smaller_ones() -> None:
    # A vocabulary-sized embedding whose one step buys more per byte than any block tensor's, but
    # is ten times the bytes of all of them: stopping at it would leave the budget unspent.
    model = {"token_embd.weight": [Rung("Q4_0", None, 1000, 100.0), Rung("Q8_0", None, 2000, 10.0)]}
    model.update({f"blk.{i}.w": [Rung("Q2_0", 3, 10, 1.0), Rung("Q4_K", None, 20, 0.5)] for i in range(10)})
    base = 1000 + 10 * 10
    short = allocate(model, base + 100)  # room for every small step, not for the embedding's
    assert short["token_embd.weight"] == 0 and all(short[f"blk.{i}.w"] == 1 for i in range(10))
    assert allocate(model, base + 1100) == {name: 1 for name in model}
    assert upgrades(model)[-1] == ("token_embd.weight", 1), "the giant waits for as many bytes"


def test_an_auto_decompose_is_cached_under_the_allocators_version() -> None:
    from pipeline.stages import decompose
    from pipeline.stages.base import JobSpec
    from pipeline.ternary.allocate import ALLOCATOR_VERSION

    auto = decompose.make_params(JobSpec("acme/m", "auto", {"target_bpw": 5.0}))
    assert ALLOCATOR_VERSION in (decompose.cache_identity(auto) or "")
    # Other recipes allocate nothing: their cache keys stay what they were.
    assert decompose.cache_identity(decompose.make_params(JobSpec("acme/m", "tq2_0"))) == ""
