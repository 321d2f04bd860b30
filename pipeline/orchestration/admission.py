"""Admission by fair share, over the rows: what waits, what each team holds, and which work the chooser
(`fair_share.choose`) lets start."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.core.teams import Teams
from pipeline.db import team_usage
from pipeline.db.models import Job
from pipeline.orchestration.fair_share import Waiting, choose

__all__ = ["next_job", "EMBEDDED_QUEUE"]

# Embedded mode's one slot: a whole job at a time.
EMBEDDED_QUEUE = "embedded"


def next_job(session: Session, job_ids: Sequence[int], teams: Teams) -> int:
    """Which of the waiting ``job_ids`` gets embedded mode's one free slot."""
    rows = session.execute(select(Job.id, Job.team, Job.priority, Job.created_at).where(Job.id.in_(job_ids)))
    waiting = [Waiting(job_id, team, priority, created, EMBEDDED_QUEUE)
               for job_id, team, priority, created in rows]
    if not waiting:
        return min(job_ids)  # rows gone (a test's database reset): the run itself reports it
    usage = {team: use.usage_s for team, use in
             team_usage.usage_by_team(session, teams.usage_half_life_s, {w.team for w in waiting}).items()}
    admitted = choose(waiting, {EMBEDDED_QUEUE: 1}, {}, usage, teams).admitted
    return admitted[0].key if admitted else min(job_ids)
