"""When a queued run's message counts as lost: the decision the reconciler takes for held messages."""

from __future__ import annotations

from pipeline.orchestration.distributed.broker_view import BrokerView, is_orphaned

VIEW = BrokerView(waiting=frozenset({"waiting"}), unacked={"held": 100.0, "fresh": 199.0})


def test_a_waiting_message_is_never_orphaned() -> None:
    assert not is_orphaned("waiting", VIEW, set(), now_s=10_000.0, grace_s=3.0)


def test_a_message_held_by_a_live_worker_is_left_alone() -> None:
    assert not is_orphaned("held", VIEW, {"held"}, now_s=10_000.0, grace_s=3.0)


def test_a_message_held_by_nobody_alive_is_orphaned_after_the_grace_period() -> None:
    assert is_orphaned("held", VIEW, set(), now_s=200.0, grace_s=3.0)
    assert not is_orphaned("fresh", VIEW, set(), now_s=200.0, grace_s=3.0)  # just taken: may yet report


def test_a_message_the_broker_lost_is_orphaned() -> None:
    assert is_orphaned("gone", VIEW, set(), now_s=200.0, grace_s=3.0)
    assert is_orphaned("anything", None, set(), now_s=200.0, grace_s=3.0)  # no view: by age alone
