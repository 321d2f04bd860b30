"""Which waiting work gets the free slots: the fair-share chooser both modes admit by. Pure: no I/O.

Each free slot goes, in turn, to the team furthest below its weighted share of the running slots
(fewest in flight per unit of weight); among equals to the team with the least decayed usage per unit
of weight; within a team to its highest priority, then its oldest. A team at ``max_running`` takes no
slot. Distributed mode admits stage attempts into bounded broker queues; embedded mode admits whole
jobs into its one slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pipeline.core.teams import Teams

__all__ = ["Waiting", "Admission", "choose"]


@dataclass(frozen=True)
class Waiting:
    """One unit of work waiting for a slot of ``queue``: an attempt (or an embedded job) of ``team``."""

    key: int
    team: str
    priority: int
    created: datetime
    queue: str


@dataclass(frozen=True)
class Admission:
    """What to start now, in order, and why each of the rest waits (by key)."""

    admitted: tuple[Waiting, ...] = ()
    reasons: Mapping[int, str] = field(default_factory=dict)


def choose(waiting: Sequence[Waiting], free: Mapping[str, int], in_flight: Mapping[str, int],
           usage: Mapping[str, float], teams: Teams, total: int | None = None) -> Admission:
    """Hand out ``free`` slots per queue to ``waiting`` work, at most ``total`` in all (None: no bound
    beyond the queues'), given each team's attempts ``in_flight`` and decayed ``usage`` (seconds)."""
    free = dict(free)
    running = {team: in_flight.get(team, 0) for team in {w.team for w in waiting}}
    queues: dict[str, list[Waiting]] = {}
    for item in sorted(waiting, key=lambda w: (-w.priority, w.created, w.key)):
        queues.setdefault(item.team, []).append(item)
    admitted: list[Waiting] = []
    ahead: dict[str, int] = {}  # per queue: work admitted before the rest
    while True:
        offers: list[tuple[tuple[float, float, str], Waiting]] = []
        for team, items in queues.items():
            policy = teams.policy(team)
            if policy.max_running is not None and running[team] >= policy.max_running:
                continue
            offer = next((w for w in items if free.get(w.queue, 0) > 0), None)
            if offer is not None:
                rank = (running[team] / policy.weight, usage.get(team, 0.0) / policy.weight, team)
                offers.append((rank, offer))
        if not offers or (total is not None and len(admitted) >= total):
            break
        _, item = min(offers, key=lambda pair: pair[0])
        queues[item.team].remove(item)
        free[item.queue] -= 1
        running[item.team] += 1
        ahead[item.queue] = ahead.get(item.queue, 0) + 1
        admitted.append(item)
    reasons = {item.key: _reason(item, running, ahead, free, teams)
               for items in queues.values() for item in items}
    return Admission(tuple(admitted), reasons)


def _reason(item: Waiting, running: Mapping[str, int], ahead: Mapping[str, int],
            free_after: Mapping[str, int], teams: Teams) -> str:
    cap = teams.policy(item.team).max_running
    if cap is not None and running[item.team] >= cap:
        return f"team {item.team} at max_running {cap}"
    admitted = ahead.get(item.queue, 0)
    if free_after.get(item.queue, 0) > 0:
        return f"every worker slot is taken: {sum(ahead.values())} waiting attempt(s) admitted first"
    if admitted:
        return f"queue {item.queue} is full: {admitted} waiting attempt(s) admitted first"
    return f"queue {item.queue} is full"
