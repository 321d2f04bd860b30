"""What each team holds of the service now, read from the rows: unfinished jobs, attempts in flight and
waiting, usage decayed by a half-life, and stored bytes its jobs first wrote. Fair share admits by these,
the caps refuse by them, and `bonsai teams` shows them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline.core.states import JobState, StageState
from pipeline.db.models import Artifact, Job, StageRun, as_utc, utcnow

__all__ = ["TeamUsage", "unfinished_jobs", "stored_bytes", "usage_by_team", "decayed_usage", "decayed",
           "UNFINISHED", "IN_FLIGHT"]

UNFINISHED = (JobState.PENDING.value, JobState.RUNNING.value)
IN_FLIGHT = (StageState.QUEUED.value, StageState.RUNNING.value)
# Runs that ended more than this many half-lives ago weigh under 1/1024 of a fresh one: left out.
_HALF_LIVES_KEPT = 10


@dataclass(frozen=True)
class TeamUsage:
    team: str
    unfinished_jobs: int = 0
    in_flight: int = 0
    waiting: int = 0
    usage_s: float = 0.0
    stored_bytes: int = 0


def decayed(seconds: float, age_s: float, half_life_s: float) -> float:
    """``seconds`` of work that ended ``age_s`` ago, as they count now."""
    return float(seconds * 0.5 ** (max(0.0, age_s) / half_life_s))


def unfinished_jobs(session: Session, team: str) -> int:
    query = select(func.count(Job.id)).where(Job.team == team, Job.status.in_(UNFINISHED))
    return int(session.scalar(query) or 0)


def stored_bytes(session: Session, team: str) -> int:
    """Bytes kept in the store whose first writer was a job of ``team`` (reusers do not pay again)."""
    query = (select(func.coalesce(func.sum(Artifact.size_bytes), 0))
             .join(StageRun, StageRun.id == Artifact.created_by_run_id).join(Job, Job.id == StageRun.job_id)
             .where(Job.team == team, Artifact.released_at.is_(None)))
    return int(session.scalar(query) or 0)


def decayed_usage(session: Session, half_life_s: float, teams: Iterable[str] | None = None,
                  now: datetime | None = None) -> dict[str, float]:
    """Stage seconds each team used (of ``teams``, or all), each run's decayed by its age."""
    now = as_utc(now or utcnow())
    since = now - timedelta(seconds=half_life_s * _HALF_LIVES_KEPT)
    ended = (select(Job.team, StageRun.started_at, StageRun.finished_at).join(Job, Job.id == StageRun.job_id)
             .where(StageRun.finished_at >= since, StageRun.started_at.is_not(None)))
    if teams is not None:
        ended = ended.where(Job.team.in_(list(teams)))
    used: dict[str, float] = {}
    for team, started, finished in session.execute(ended):
        if started is None or finished is None:
            continue
        age = (now - as_utc(finished)).total_seconds()
        work = (as_utc(finished) - as_utc(started)).total_seconds()
        used[team] = used.get(team, 0.0) + decayed(work, age, half_life_s)
    return used


def usage_by_team(session: Session, half_life_s: float, teams: Iterable[str] = (),
                  now: datetime | None = None) -> dict[str, TeamUsage]:
    """Every team with unfinished jobs or recent work, and every team of ``teams``."""
    counts: dict[str, dict[str, float]] = {team: {} for team in teams}
    for team, n in session.execute(select(Job.team, func.count(Job.id))
                                   .where(Job.status.in_(UNFINISHED)).group_by(Job.team)):
        counts.setdefault(team, {})["unfinished_jobs"] = n
    attempts = (select(Job.team, StageRun.status, func.count(StageRun.id))
                .join(Job, Job.id == StageRun.job_id)
                .where(StageRun.status.in_((*IN_FLIGHT, StageState.PENDING.value)),
                       Job.status.in_(UNFINISHED))
                .group_by(Job.team, StageRun.status))
    for team, state, n in session.execute(attempts):
        key = "waiting" if StageState(state) is StageState.PENDING else "in_flight"
        entry = counts.setdefault(team, {})
        entry[key] = entry.get(key, 0) + n
    for team, used_s in decayed_usage(session, half_life_s, now=now).items():
        counts.setdefault(team, {})["usage_s"] = used_s
    stored = (select(Job.team, func.sum(Artifact.size_bytes))
              .join(StageRun, StageRun.id == Artifact.created_by_run_id).join(Job, Job.id == StageRun.job_id)
              .where(Artifact.released_at.is_(None)).group_by(Job.team))
    for team, size in session.execute(stored):
        counts.setdefault(team, {})["stored_bytes"] = int(size or 0)
    return {team: TeamUsage(team, int(c.get("unfinished_jobs", 0)), int(c.get("in_flight", 0)),
                            int(c.get("waiting", 0)), float(c.get("usage_s", 0.0)),
                            int(c.get("stored_bytes", 0)))
            for team, c in sorted(counts.items())}

