"""What the Redis broker holds: messages waiting in a queue, and messages delivered but not acked.

A message in the ``unacked`` hash was handed to some consumer; Redis gives it back only after
that consumer's visibility timeout (hours here, to outlast the longest stage). Whether such a
message is still being worked on is decided against the worker heartbeats in the database
(`is_orphaned`): held by a live worker, it is left alone; held by nobody alive, the run is
sent again under a new task id and the atomic claim makes any late copy harmless.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.orchestration.queues import QUEUES

__all__ = ["BrokerView", "read_broker", "is_orphaned"]

log = logging.getLogger(__name__)

_PRIORITY_STEPS = range(1, 10)


@dataclass(frozen=True)
class BrokerView:
    """Task ids waiting in a queue, and delivered-unacked task ids with their delivery time (epoch s)."""

    waiting: frozenset[str] = frozenset()
    unacked: dict[str, float] = field(default_factory=dict)

    def holds(self, task_id: str | None) -> bool:
        return task_id is not None and (task_id in self.waiting or task_id in self.unacked)


def read_broker(connection: Any) -> BrokerView:
    """Read every queue list and the unacked hash of a kombu Redis connection."""
    client = connection.default_channel.client
    waiting: set[str] = set()
    for name in _queue_lists(QUEUES):
        for raw in client.lrange(name, 0, -1):
            waiting.add(_task_id(json.loads(raw)))
    delivered = {tag: float(score) for tag, score in client.zrange("unacked_index", 0, -1, withscores=True)}
    unacked: dict[str, float] = {}
    for tag, raw in client.hgetall("unacked").items():
        message = json.loads(raw)[0]
        unacked[_task_id(message)] = delivered.get(tag, 0.0)
    return BrokerView(frozenset(waiting), unacked)


def _queue_lists(queues: Iterable[str]) -> list[str]:
    return [name for queue in queues for name in (queue, *(f"{queue}:{p}" for p in _PRIORITY_STEPS))]


def _task_id(message: dict[str, Any]) -> str:
    return str(message["headers"]["id"])


def is_orphaned(task_id: str | None, view: BrokerView | None, held_by_live_workers: set[str],
                now_s: float, grace_s: float) -> bool:
    """Whether a queued run's message is lost: gone from the broker, or delivered to a consumer that
    no live worker is (after `grace_s`, so a worker that just took it can report it first).

    With no broker view (not Redis, or unreachable) a queued run past its age limit is resent:
    a duplicate message costs a no-op claim, a lost one a stuck job.
    """
    if view is None or task_id is None:
        return True
    if task_id in view.waiting:
        return False
    delivered_s = view.unacked.get(task_id)
    if delivered_s is None:
        return True
    if task_id in held_by_live_workers:
        return False
    return now_s - delivered_s > grace_s
