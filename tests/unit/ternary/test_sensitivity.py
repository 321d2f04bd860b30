"""Measured rung costs: groups, depths, how a group's measured rise is shared, and nesting."""

from __future__ import annotations

import pytest

from pipeline.ternary.allocate import Rung, allocate, hull
from pipeline.ternary.sensitivity import depths_of, groups_of, lowered, measured_rungs, predicted_kl


def _ladder(costs: list[float], cols: int = 1) -> list[Rung]:
    """Four rungs (Q2_0/3, Q2_0/4, Q4_K, Q8_0) with these proxy costs and their bytes per weight."""
    labels = [("Q2_0", 3, 18), ("Q2_0", 4, 18), ("Q4_K", None, 36), ("Q8_0", None, 68)]
    return [Rung(t, lv, n * cols, c) for (t, lv, n), c in zip(labels, costs, strict=True)]


def test_groups_split_each_kind_into_layer_spans() -> None:
    names = [f"blk.{i}.{k}.weight" for i in range(7) for k in ("attn_q", "ffn_down")] + ["token_embd.weight"]
    groups = groups_of(names, spans=3)
    assert list(groups) == ["attn_q[0-2]", "attn_q[3-5]", "attn_q[6-6]", "ffn_down[0-2]", "ffn_down[3-5]",
                            "ffn_down[6-6]", "token_embd"]
    assert groups["ffn_down[3-5]"] == [f"blk.{i}.ffn_down.weight" for i in (3, 4, 5)]
    assert sorted(n for g in groups.values() for n in g) == sorted(names)


def test_depths_go_down_each_tensors_own_hull() -> None:
    # b's Q2_0/4 rung buys nothing over Q2_0/3 (same bytes, more error): its hull has three rungs.
    rungs = {"a": _ladder([9.0, 5.0, 1.0, 0.1]), "b": _ladder([9.0, 9.5, 1.0, 0.1])}
    assert hull(rungs["b"]) == [0, 2, 3]
    assert depths_of(rungs, ["a", "b"]) == 2
    assert lowered(rungs, ["a", "b"], 0) == {"a": 3, "b": 3}
    assert lowered(rungs, ["a", "b"], 1) == {"a": 2, "b": 2}
    assert lowered(rungs, ["a", "b"], 2) == {"a": 1, "b": 0}
    assert lowered(rungs, ["a", "b"], 5) == {"a": 1, "b": 0}


def test_a_groups_tensors_share_its_measured_rise_by_their_proxy() -> None:
    rungs = {"blk.0.ffn_up.weight": _ladder([9.0, 6.0, 4.0, 3.0]),
             "blk.1.ffn_up.weight": _ladder([9.0, 8.0, 5.0, 3.0])}
    groups = {"ffn_up[0-1]": list(rungs)}
    costs = measured_rungs(rungs, groups, {("ffn_up[0-1]", 1): 0.3, ("ffn_up[0-1]", 2): 0.5})
    a, b = costs["blk.0.ffn_up.weight"], costs["blk.1.ffn_up.weight"]
    assert a[3].cost == b[3].cost == 0.0  # the base costs nothing
    # Depth 1 (Q4_K): proxy rises 1 and 2 share 0.3 as 0.1 and 0.2.
    assert a[2].cost == pytest.approx(0.1) and b[2].cost == pytest.approx(0.2)
    # Depth 2 (Q2_0/4, which costs Q2_0/3's bytes and less error): the further 0.2 by rises 2 and 3.
    assert a[1].cost == pytest.approx(0.1 + 0.08) and b[1].cost == pytest.approx(0.2 + 0.12)
    assert a[0].cost > a[1].cost and hull(a) == [1, 2, 3]
    # Every depth's costs sum to the group's measured rise; bytes are untouched.
    assert a[1].cost + b[1].cost == pytest.approx(0.5)
    assert [r.n_bytes for r in a] == [r.n_bytes for r in rungs["blk.0.ffn_up.weight"]]


def test_a_step_that_measures_no_worse_is_never_bought_and_off_hull_rungs_stay_off() -> None:
    rungs = {"x": _ladder([9.0, 9.5, 2.0, 1.0])}  # Q2_0/4 is off the hull
    costs = measured_rungs(rungs, {"x": ["x"]}, {("x", 1): -0.01, ("x", 2): 0.4})
    # Lowering to Q4_K measured no rise (noise below the base): Q8_0's bytes buy nothing.
    assert costs["x"][2].cost == 0.0 == costs["x"][3].cost
    assert hull(costs["x"]) == [0, 2]
    assert costs["x"][0].cost == 0.4 < costs["x"][1].cost == pytest.approx(0.4)
    assert allocate(costs, budget_bytes=1000) == {"x": 2}


def test_allocations_on_measured_costs_are_nested_and_predict_their_kl() -> None:
    names = [f"blk.{i}.{k}.weight" for i in range(4) for k in ("attn_q", "ffn_down")]
    rungs = {n: _ladder([8.0 + i, 5.0, 2.0 + i / 10, 0.5], cols=10) for i, n in enumerate(names)}
    groups = groups_of(names, spans=2)
    rises = {(g, d): (0.02 if g.startswith("attn") else 0.3) * d ** 2 for g in groups for d in (1, 2, 3)}
    costs = measured_rungs(rungs, groups, rises)
    low = sum(r[0].n_bytes for r in costs.values())
    previous: dict[str, int] | None = None
    for budget in range(low, low + 500 * len(names), 97):
        chosen = allocate(costs, budget)
        if previous is not None:
            assert all(chosen[n] >= previous[n] for n in names), "a larger budget moved a tensor down"
        previous = chosen
    # Q2_0/4 costs no more bytes than Q2_0/3 and holds more: the hulls start there, two steps deep.
    assert all(hull(r) == [1, 2, 3] for r in costs.values())
    # ffn_down's steps measure dearer: the first two upgrades the budget buys are ffn_down's.
    first = allocate(costs, low + 180 * 2)
    raised = [n for n in names if first[n] > 1]
    assert len(raised) == 2 and all(".ffn_down." in n for n in raised)
    assert predicted_kl(0.01, costs, {n: 3 for n in names}) == pytest.approx(0.01)
    cheapest = allocate(costs, 0)
    assert predicted_kl(0.01, costs, cheapest) == pytest.approx(0.01 + sum(rises[(g, 2)] for g in groups))


def test_a_depth_without_a_measurement_is_an_error() -> None:
    rungs = {"x": _ladder([9.0, 5.0, 2.0, 1.0])}
    with pytest.raises(ValueError, match="no measured rise for group x at depth 2"):
        measured_rungs(rungs, {"x": ["x"]}, {("x", 1): 0.1})
