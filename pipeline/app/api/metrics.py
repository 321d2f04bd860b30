"""Prometheus metrics, computed from the database at scrape time.

The database is the single source of truth, so every number here is read from it on
each scrape rather than counted in process memory: several API processes, workers and
restarts all report the same values.

- ``bonsai_jobs{status}``: jobs by status (every status listed, zeros included);
- ``bonsai_stage_runs{stage,status}``: attempts by stage and status;
- ``bonsai_stage_duration_seconds{stage,status}``: histogram of finished attempts' run time;
- ``bonsai_queue_depth{queue}``: attempts queued for each worker queue (io, cpu, gpu);
- ``bonsai_stage_failures_total{stage,error_kind}``: failed attempts by error kind;
- ``bonsai_team_running{team}``, ``bonsai_team_waiting{team}``, ``bonsai_team_unfinished_jobs{team}``,
  ``bonsai_team_usage_seconds{team}`` (decayed) and ``bonsai_team_stored_bytes{team}``: what each team
  holds (`db.team_usage`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from pipeline.core.states import JobState, StageName, StageState
from pipeline.core.teams import NO_TEAMS, Teams
from pipeline.db import team_usage
from pipeline.db.models import Job, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.queues import QUEUE_OF

__all__ = ["DatabaseCollector", "DURATION_BUCKETS_S", "make_registry", "render_metrics", "queue_of"]

# Stages last from milliseconds (cached) to hours (decompose of a large model).
DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0)


def queue_of() -> dict[str, str]:
    """Stage name -> worker queue (the routing table; no Celery needed)."""
    return {stage.value: queue for stage, queue in QUEUE_OF.items()}


class DatabaseCollector(Collector):
    """Reads the metric families from the database on every collect()."""

    def __init__(self, sessions: sessionmaker[Session], teams: Teams = NO_TEAMS) -> None:
        self._sessions, self._teams = sessions, teams

    def collect(self) -> Iterator[Metric]:
        with session_scope(self._sessions) as session:
            yield self._jobs(session)
            yield self._runs(session)
            yield self._durations(session)
            yield self._queues(session)
            yield self._failures(session)
            yield from self._team_gauges(session)

    @staticmethod
    def _jobs(session: Session) -> Metric:
        counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        family = GaugeMetricFamily("bonsai_jobs", "Jobs by status.", labels=["status"])
        for state in JobState:
            family.add_metric([state.value], counts.get(state, 0))
        return family

    @staticmethod
    def _runs(session: Session) -> Metric:
        rows = session.execute(
            select(StageRun.stage, StageRun.status, func.count()).group_by(StageRun.stage, StageRun.status)
        ).all()
        family = GaugeMetricFamily(
            "bonsai_stage_runs", "Stage attempts by stage and status.", labels=["stage", "status"]
        )
        for stage, state, count in sorted(rows):
            family.add_metric([stage, state], count)
        return family

    @staticmethod
    def _durations(session: Session) -> Metric:
        rows = session.execute(
            select(StageRun.stage, StageRun.status, StageRun.started_at, StageRun.finished_at).where(
                StageRun.started_at.is_not(None), StageRun.finished_at.is_not(None)
            )
        ).all()
        samples: dict[tuple[StageName, StageState], list[float]] = {}
        for stage, state, started, finished in rows:
            if started is not None and finished is not None:  # filtered in SQL; this tells the type checker
                samples.setdefault((stage, state), []).append(max(0.0, (finished - started).total_seconds()))
        family = HistogramMetricFamily(
            "bonsai_stage_duration_seconds",
            "Run time of finished stage attempts.",
            labels=["stage", "status"],
        )
        for (stage, state), values in sorted(samples.items()):
            family.add_metric([stage, state], _buckets(values), sum_value=sum(values))
        return family

    @staticmethod
    def _queues(session: Session) -> Metric:
        queued = session.execute(
            select(StageRun.stage, func.count())
            .where(StageRun.status == StageState.QUEUED)
            .group_by(StageRun.stage)
        ).all()
        routes = queue_of()
        depth = dict.fromkeys(sorted(set(routes.values())), 0)
        for stage, count in queued:
            depth[routes.get(stage, "unknown")] = depth.get(routes.get(stage, "unknown"), 0) + count
        family = GaugeMetricFamily(
            "bonsai_queue_depth", "Stage attempts queued, by worker queue.", labels=["queue"]
        )
        for queue, count in depth.items():
            family.add_metric([queue], count)
        return family

    @staticmethod
    def _failures(session: Session) -> Metric:
        rows = session.execute(
            select(StageRun.stage, StageRun.error_kind, func.count())
            .where(StageRun.status == StageState.FAILED)
            .group_by(StageRun.stage, StageRun.error_kind)
        ).all()
        family = CounterMetricFamily(
            "bonsai_stage_failures", "Failed stage attempts by error kind.", labels=["stage", "error_kind"]
        )
        for stage, kind, count in sorted(rows, key=lambda r: (r[0], r[1] or "")):
            family.add_metric([stage, kind or "unknown"], count)
        return family


    def _team_gauges(self, session: Session) -> Iterator[Metric]:
        usage = team_usage.usage_by_team(session, self._teams.usage_half_life_s, self._teams.policies)
        for field, name, help_text in _TEAM_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["team"])
            for team, use in usage.items():
                family.add_metric([team], float(getattr(use, field)))
            yield family


# TeamUsage field, metric name, help.
_TEAM_GAUGES = (
    ("in_flight", "bonsai_team_running", "Attempts of the team queued or running."),
    ("waiting", "bonsai_team_waiting", "Attempts of the team waiting for admission."),
    ("unfinished_jobs", "bonsai_team_unfinished_jobs", "Jobs of the team pending or running."),
    ("usage_s", "bonsai_team_usage_seconds", "Stage seconds the team used, decayed by the half-life."),
    ("stored_bytes", "bonsai_team_stored_bytes", "Stored bytes the team's jobs first wrote."),
)


def _buckets(values: list[float]) -> list[tuple[str, float]]:
    ordered = sorted(values)
    buckets: list[tuple[str, float]] = []
    index = 0
    for bound in DURATION_BUCKETS_S:
        while index < len(ordered) and ordered[index] <= bound:
            index += 1
        buckets.append((repr(bound), float(index)))
    buckets.append(("+Inf", float(len(ordered))))
    return buckets


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The text exposition format of everything in `registry`."""
    return generate_latest(registry)


def make_registry(sessions: sessionmaker[Session], teams: Teams = NO_TEAMS) -> CollectorRegistry:
    """A registry of its own (not the global one): one per app, so tests can build many apps."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(sessions, teams))
    return registry
