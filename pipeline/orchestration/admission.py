"""Admission by fair share, over the rows: what waits, what each team holds, and which work the chooser
(`fair_share.choose`) lets start.

Distributed mode keeps the broker short: each queue holds about as many attempts in flight as the live
workers serving it have slots (at least one, so work moves before any worker has beaten), and all queues
together two per worker slot (a worker serves several queues: one running, one waiting). The rest of the
ready attempts wait in the database as pending, with ``ready_at`` set, until a slot frees; then the
chooser admits them and they are queued and sent. A retry's backoff and shard children are sent
directly (they continue work already admitted).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, aliased

from pipeline.core.states import StageName, StageState
from pipeline.core.teams import Teams
from pipeline.db import repo, team_usage
from pipeline.db.models import Job, StageRun, Worker
from pipeline.orchestration.fair_share import Admission, Waiting, choose
from pipeline.orchestration.queues import QUEUE_OF, QUEUES

__all__ = ["next_job", "EMBEDDED_QUEUE", "Admitted", "admit_attempts", "queue_slots", "waiting_reasons"]

# Embedded mode's one slot: a whole job at a time.
EMBEDDED_QUEUE = "embedded"
# PostgreSQL advisory lock key of admission: two dispatchers never hand out the same free slot.
_ADMISSION_KEY = -0x626F6E7361690002


@dataclass(frozen=True)
class Admitted:
    """An attempt admitted and marked queued under ``task_id``: send it."""

    stage: StageName
    run_id: int
    task_id: str


def next_job(session: Session, job_ids: Sequence[int], teams: Teams) -> int:
    """Which of the waiting ``job_ids`` gets embedded mode's one free slot."""
    rows = session.execute(select(Job.id, Job.team, Job.priority, Job.created_at).where(Job.id.in_(job_ids)))
    waiting = [Waiting(job_id, team, priority, created, EMBEDDED_QUEUE)
               for job_id, team, priority, created in rows]
    if not waiting:
        return min(job_ids)  # rows gone (a test's database reset): the run itself reports it
    admitted = choose(waiting, {EMBEDDED_QUEUE: 1}, {}, _usage(session, waiting, teams), teams).admitted
    return admitted[0].key if admitted else min(job_ids)


def queue_slots(session: Session, workers_since: datetime) -> tuple[dict[str, int], int]:
    """Per queue, the slots of the live workers serving it, and the slots of all of them; each at least
    one."""
    slots = dict.fromkeys(QUEUES, 0)
    every = 0
    for worker in session.scalars(select(Worker).where(Worker.heartbeat_at >= workers_since,
                                                       Worker.stopped_at.is_(None))):
        every += max(1, worker.concurrency)
        for queue in worker.queues or []:
            if queue in slots:
                slots[queue] += max(1, worker.concurrency)
    return {queue: max(1, count) for queue, count in slots.items()}, max(1, every)


def admit_attempts(session: Session, teams: Teams,
                   workers_since: datetime) -> tuple[list[Admitted], Admission]:
    """Admit waiting attempts into the free slots of their queues, marking each queued under a new task
    id (the caller sends them after commit); with the chooser's answer (why the rest wait)."""
    _hold_admission(session)
    admission = _choose(session, teams, workers_since, only_if_free=True)
    admitted = []
    for item in admission.admitted:
        run = session.get_one(StageRun, item.key)
        task_id = str(uuid.uuid4())
        repo.set_stage_state(session, run, StageState.QUEUED, task_id=task_id)
        admitted.append(Admitted(run.stage, run.id, task_id))
    return admitted, admission


def waiting_reasons(session: Session, teams: Teams, workers_since: datetime) -> dict[int, str]:
    """Why each attempt waiting for admission waits (by run id), as the chooser sees it now."""
    admission = _choose(session, teams, workers_since, only_if_free=False)
    return {**{item.key: "next to be admitted" for item in admission.admitted}, **admission.reasons}


def _choose(session: Session, teams: Teams, workers_since: datetime, only_if_free: bool) -> Admission:
    busy_queues, busy_teams = _in_flight(session)
    slots, worker_slots = queue_slots(session, workers_since)
    free = {queue: slots[queue] - busy_queues.get(queue, 0) for queue in slots}
    # Workers serve several queues: in all, a running attempt and one waiting per worker slot.
    total = max(0, 2 * worker_slots - sum(busy_teams.values()))
    if only_if_free and total == 0:
        return Admission()
    # To admit, each team's first few per stage are enough (no more than ``total`` go in); to explain,
    # every waiting attempt.
    waiting = _waiting(session, total if only_if_free else None)
    if not waiting or (only_if_free and not any(free[w.queue] > 0 for w in waiting)):
        return Admission()
    return choose(waiting, free, busy_teams, _usage(session, waiting, teams), teams, total)


def _waiting(session: Session, first: int | None) -> list[Waiting]:
    """Attempts waiting for admission; with ``first``, only the first that many of each team and stage
    (by priority, then age)."""
    order = (Job.priority.desc(), StageRun.ready_at, StageRun.id)
    rank = func.row_number().over(partition_by=(Job.team, StageRun.stage), order_by=order).label("rank")
    ready = (select(StageRun.id, StageRun.stage, StageRun.ready_at, Job.team, Job.priority, rank)
             .join(Job, Job.id == StageRun.job_id)
             .where(StageRun.status == StageState.PENDING.value, StageRun.ready_at.is_not(None),
                    StageRun.parent_run_id.is_(None), Job.status.in_(team_usage.UNFINISHED))).subquery()
    query = select(ready.c.id, ready.c.stage, ready.c.ready_at, ready.c.team, ready.c.priority)
    if first is not None:
        query = query.where(ready.c.rank <= first)
    return [Waiting(run_id, team, priority, ready_at, QUEUE_OF[StageName(stage)])
            for run_id, stage, ready_at, team, priority in session.execute(query) if ready_at is not None]


def _in_flight(session: Session) -> tuple[dict[str, int], dict[str, int]]:
    """Attempts queued or running, per queue and per team. A parent whose shards do its work holds no slot."""
    child = aliased(StageRun)
    has_shards = select(child.id).where(child.parent_run_id == StageRun.id).exists()
    rows = session.execute(
        select(StageRun.stage, Job.team, func.count(StageRun.id)).join(Job, Job.id == StageRun.job_id)
        .where(StageRun.status.in_(team_usage.IN_FLIGHT), ~has_shards).group_by(StageRun.stage, Job.team))
    queues: dict[str, int] = {}
    teams: dict[str, int] = {}
    for stage, team, count in rows:
        queue = QUEUE_OF[StageName(stage)]
        queues[queue] = queues.get(queue, 0) + count
        teams[team] = teams.get(team, 0) + count
    return queues, teams


def _usage(session: Session, waiting: Sequence[Waiting], teams: Teams) -> dict[str, float]:
    """Decayed usage of the waiting teams; nothing to read when only one team waits (no choice)."""
    names = {w.team for w in waiting}
    if len(names) < 2:
        return {}
    return team_usage.decayed_usage(session, teams.usage_half_life_s, names)


def _hold_admission(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADMISSION_KEY})
