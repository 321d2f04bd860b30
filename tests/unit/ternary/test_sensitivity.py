"""Measured rung costs: groups, depths, how a group's measured rise is shared, and nesting."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.ternary.allocate import Rung, allocate, hull
from pipeline.ternary.sensitivity import (
    along_chain,
    depths_of,
    descend,
    groups_of,
    lowered,
    measured_rungs,
    predicted_kl,
)


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


def _interacting(rungs: dict[str, list[Rung]], groups: dict[str, list[str]],
                 alone: dict[tuple[str, int], float]) -> tuple[list[dict[str, int]], Any]:
    """A stand-in for llama.cpp: a group's own rise at its depth, and the errors compound: with two
    attn groups low, attn's rises are three times as large. Records every file it 'runs'."""
    runs: list[dict[str, int]] = []

    def measure(chosen: dict[str, int]) -> tuple[float, float]:
        runs.append(chosen)
        depth = {g: next(d for d in range(4) if lowered(rungs, names, d) == {n: chosen[n] for n in names})
                 for g, names in groups.items()}
        attn_low = sum(1 for g, d in depth.items() if d and g.startswith("attn"))
        kl = 0.01 + sum(alone[(g, d)] * (3.0 if g.startswith("attn") and attn_low > 1 else 1.0)
                        for g, d in depth.items() if d)
        return kl, 1.0 - kl

    return runs, measure


def test_the_chain_measures_each_step_in_context_and_stops_measuring_where_files_break() -> None:
    names = [f"blk.{i}.{k}.weight" for i in range(2) for k in ("attn_q", "ffn_down")]
    rungs = {n: _ladder([9.0, 5.0, 2.0, 0.5]) for n in names}
    groups = groups_of(names, spans=2)
    assert sorted(groups) == ["attn_q[0-0]", "attn_q[1-1]", "ffn_down[0-0]", "ffn_down[1-1]"]
    # Alone from the base, attn looks cheapest; once another attn group is low it is the dearest.
    alone = {(g, d): (0.02 if g.startswith("attn") else 0.05) * d for g in groups for d in (1, 2)}
    runs, measure = _interacting(rungs, groups, alone)
    chain = descend(rungs, groups, alone, 0.01, measure, stop_kl=0.3)
    # Every group goes down its hull (two steps), each step after the one before it.
    assert sorted((c.group, c.depth) for c in chain) == sorted((g, d) for g in groups for d in (1, 2))
    for group in groups:
        assert [c.depth for c in chain if c.group == group] == [1, 2]
    # The first group down is an attn one (cheapest alone); once it is low, ffn's steps are taken
    # before the other attn group's, which the single-group rises would have put first.
    order = [c.group for c in chain]
    first_attn = order[0]
    other_attn = next(g for g in groups if g.startswith("attn") and g != first_attn)
    assert first_attn.startswith("attn")
    assert order.index("ffn_down[0-0]") < order.index(other_attn) > order.index("ffn_down[1-1]")
    # Each measured figure is the file's, with every step before it; past stop_kl nothing is run.
    measured = [c for c in chain if c.kl is not None]
    assert measured and all(c.kl is None for c in chain[len(measured):])
    assert measured[-1].kl >= 0.3 and all(c.kl < 0.3 for c in measured[:-1])
    assert len(runs) < len(chain) * len(groups)  # lazy: not every step re-measured at every point
    # A budget takes the first point that fits: nested, and within the budget.
    low = sum(r[hull(r)[0]].n_bytes for r in rungs.values())
    high = sum(r[-1].n_bytes for r in rungs.values())
    previous: dict[str, int] | None = None
    for budget in range(low, high + 1, 7):
        chosen, taken = along_chain(rungs, groups, chain, budget)
        assert sum(rungs[n][i].n_bytes for n, i in chosen.items()) <= budget
        assert 0 <= taken <= len(chain)
        if previous is not None:
            assert all(chosen[n] >= previous[n] for n in names), "a larger budget moved a tensor down"
        previous = chosen
    assert along_chain(rungs, groups, chain, high) == ({n: 3 for n in names}, 0)
    assert along_chain(rungs, groups, chain, 0)[1] == len(chain)
