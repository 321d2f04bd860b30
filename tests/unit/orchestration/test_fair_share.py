"""The fair-share chooser: weighted shares of the slots, max_running, decayed usage between equals,
priority and age within a team, and one team alone using every slot."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pipeline.core.teams import TeamPolicy, Teams
from pipeline.db.team_usage import decayed
from pipeline.orchestration.fair_share import Waiting, choose

_T0 = datetime(2026, 12, 7, tzinfo=UTC)


def _work(team: str, count: int, *, first: int = 0, priority: int = 0, queue: str = "cpu") -> list[Waiting]:
    return [Waiting(first + i, team, priority, _T0 + timedelta(seconds=first + i), queue)
            for i in range(count)]


def _teams_of(admitted: tuple[Waiting, ...]) -> list[str]:
    return [item.team for item in admitted]


def test_one_team_alone_uses_every_slot() -> None:
    chosen = choose(_work("a", 10), {"cpu": 4}, {}, {}, Teams())
    assert [item.key for item in chosen.admitted] == [0, 1, 2, 3]
    assert chosen.reasons[4] == "queue cpu is full: 4 waiting attempt(s) admitted first"


def test_a_flood_at_top_priority_does_not_hold_back_another_teams_first_attempt() -> None:
    flood = _work("a", 200, priority=1_000_000)
    late = _work("b", 3, first=1000)
    # A holds both slots; one frees: B's oldest goes first, whatever A's priority.
    chosen = choose(flood + late, {"cpu": 1}, {"a": 1}, {}, Teams())
    assert [item.key for item in chosen.admitted] == [1000]


def test_slots_split_by_weight() -> None:
    teams = Teams({"a": TeamPolicy(weight=2.0)})
    chosen = choose(_work("a", 10) + _work("b", 10, first=100), {"cpu": 6}, {}, {}, teams)
    assert sorted(_teams_of(chosen.admitted)) == ["a"] * 4 + ["b"] * 2


def test_max_running_leaves_the_rest_waiting_with_its_reason() -> None:
    teams = Teams({"a": TeamPolicy(max_running=2)})
    chosen = choose(_work("a", 5) + _work("b", 1, first=100), {"cpu": 8}, {"a": 1}, {}, teams)
    assert sorted(_teams_of(chosen.admitted)) == ["a", "b"]
    assert chosen.reasons[1] == "team a at max_running 2"


def test_between_equal_shares_the_least_decayed_usage_goes_first() -> None:
    chosen = choose(_work("a", 1) + _work("b", 1, first=100), {"cpu": 1}, {}, {"a": 50.0, "b": 10.0}, Teams())
    assert _teams_of(chosen.admitted) == ["b"]
    # Weight scales usage too: a team of weight 10 with 50 s counts as 5 s.
    heavy = Teams({"a": TeamPolicy(weight=10.0)})
    both = _work("a", 1) + _work("b", 1, first=100)
    assert _teams_of(choose(both, {"cpu": 1}, {}, {"a": 50.0, "b": 10.0}, heavy).admitted) == ["a"]


def test_usage_decays_by_half_each_half_life() -> None:
    assert decayed(100.0, 0.0, 3600.0) == 100.0
    assert decayed(100.0, 3600.0, 3600.0) == 50.0
    assert decayed(100.0, 7200.0, 3600.0) == 25.0
    assert decayed(100.0, -5.0, 3600.0) == 100.0  # a clock a little behind counts it fresh


def test_within_a_team_priority_then_age() -> None:
    items = [Waiting(1, "a", 0, _T0, "cpu"), Waiting(2, "a", 5, _T0 + timedelta(seconds=9), "cpu"),
             Waiting(3, "a", 5, _T0 + timedelta(seconds=1), "cpu")]
    assert [item.key for item in choose(items, {"cpu": 3}, {}, {}, Teams()).admitted] == [3, 2, 1]


def test_each_queue_has_its_own_slots() -> None:
    items = _work("a", 2, queue="gpu") + _work("a", 2, first=10, queue="cpu")
    chosen = choose(items, {"cpu": 1, "gpu": 0}, {}, {}, Teams())
    assert [item.key for item in chosen.admitted] == [10]
    assert chosen.reasons[0] == "queue gpu is full"


def test_a_bound_on_all_queues_together_stops_admission_and_says_so() -> None:
    items = _work("a", 3, queue="io") + _work("b", 3, first=10, queue="gpu")
    chosen = choose(items, {"io": 5, "gpu": 5}, {}, {}, Teams(), total=2)
    assert sorted(_teams_of(chosen.admitted)) == ["a", "b"]  # one each: equal shares
    assert chosen.reasons[1] == "every worker slot is taken: 2 waiting attempt(s) admitted first"
