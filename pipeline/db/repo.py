"""The only code that writes status columns; every write goes through the transition table.

Functions take an open Session and leave committing to the caller, so one unit of
work (say "mark succeeded and link the outputs") commits or rolls back as a whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select, text, update
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session, aliased, selectinload

from pipeline.core.errors import InputError
from pipeline.core.states import JobState, LinkDirection, StageName, StageState, require
from pipeline.core.teams import team_of
from pipeline.db.models import Artifact, Job, Provenance, RunArtifact, StageRun, Worker, utcnow

__all__ = [
    "create_job",
    "get_job",
    "list_jobs",
    "new_attempt",
    "set_stage_state",
    "set_job_state",
    "latest_runs",
    "record_artifact",
    "artifacts_by_digest",
    "link_artifact",
    "add_provenance",
    "find_cached_run",
    "claim_run",
    "touch_heartbeat",
    "lock_cache_key",
    "running_with_key",
]


def create_job(
    session: Session,
    source: str,
    recipe: str,
    params: Mapping[str, Any] | None = None,
    priority: int = 0,
    submitted_by: str | None = None,
    team: str | None = None,
) -> Job:
    """A pending job; its team is ``team``, else the submitter's own."""
    job = Job(
        source=source,
        recipe=recipe,
        params=dict(params or {}),
        status=JobState.PENDING,
        priority=priority,
        submitted_by=submitted_by,
        team=team_of(submitted_by, team),
    )
    session.add(job)
    session.flush()
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise InputError(f"job {job_id} does not exist (see `bonsai jobs` for the list)")
    return job


def list_jobs(session: Session, status: str | None = None, limit: int | None = None) -> Sequence[Job]:
    query = select(Job).order_by(Job.id)
    if status is not None:
        query = query.where(Job.status == JobState(status).value)
    if limit is not None:
        query = query.limit(limit)
    return session.scalars(query).all()


def new_attempt(
    session: Session,
    job: Job,
    stage: StageName,
    state: StageState = StageState.PENDING,
    shard: str = "",
    parent: StageRun | None = None,
    retry_of: StageRun | None = None,
) -> StageRun:
    """Add the next attempt row for `stage` (or for one `shard` of it); earlier attempts stay.

    Retries of a failed attempt go through `retry_attempt`, which guards against doubles.
    """
    last = session.scalar(
        select(func.max(StageRun.attempt)).where(
            StageRun.job_id == job.id, StageRun.stage == stage.value, StageRun.shard == shard
        )
    )
    run = StageRun(job_id=job.id, stage=stage, shard=shard, attempt=(last or 0) + 1, status=state,
                   parent_run_id=parent.id if parent is not None else None,
                   is_forced=parent.is_forced if parent is not None else False,
                   retry_of_id=retry_of.id if retry_of is not None else None)
    if state is StageState.QUEUED:
        run.queued_at = utcnow()
    session.add(run)
    session.flush()
    return run


def retry_attempt(session: Session, failed: StageRun) -> StageRun | None:
    """The one retry of `failed` (a new pending attempt), or None when it already has one.

    The unique ``retry_of_id`` column is the guard: however many processes decide at once that
    an attempt must be retried, one insert wins and the others see its row instead.
    """
    existing = session.scalar(select(StageRun).where(StageRun.retry_of_id == failed.id))
    if existing is not None:
        return None
    parent = session.get(StageRun, failed.parent_run_id) if failed.parent_run_id else None
    try:
        with session.begin_nested():
            run = new_attempt(session, failed.job, failed.stage, shard=failed.shard, parent=parent,
                              retry_of=failed)
    except SAIntegrityError:
        return None  # another process retried it first (its row commits with its transaction)
    return run


def set_stage_state(session: Session, run: StageRun, new: StageState, **fields: Any) -> StageRun:
    """Move a stage run to `new` (checked), stamping times and any extra columns given."""
    require(run.status, new)
    now = utcnow()
    run.status = new
    if new is StageState.QUEUED:
        run.queued_at = now
    elif new is StageState.RUNNING:
        run.started_at = now
        run.heartbeat_at = now
    elif new.is_final:
        run.finished_at = now
    for name, value in fields.items():
        if not hasattr(StageRun, name):
            raise AttributeError(f"StageRun has no column {name!r}")
        setattr(run, name, value)
    session.flush()
    return run


def set_job_state(session: Session, job: Job, new: JobState, error_message: str | None = None) -> Job:
    old = job.status
    if old is new:
        return job
    require(old, new)
    now = utcnow()
    job.status = new
    if new is JobState.RUNNING:
        job.started_at = job.started_at or now
        job.finished_at = None
        job.error_message = None
    elif new.is_final:
        job.finished_at = now
    if error_message is not None:
        job.error_message = error_message
    session.flush()
    return job


def latest_runs(session: Session, job_id: int, with_links: bool = False) -> dict[StageName, StageRun]:
    """The newest attempt of each stage that has one (shard children are not stage attempts).

    `with_links` loads every attempt's links and artifacts up front (two queries, not N).
    """
    query = (
        select(StageRun).where(StageRun.job_id == job_id, StageRun.shard == "").order_by(StageRun.attempt)
    )
    if with_links:
        query = query.options(selectinload(StageRun.links).selectinload(RunArtifact.artifact))
    runs = session.scalars(query).all()
    return {run.stage: run for run in runs}


def record_artifact(
    session: Session,
    sha256: str,
    size_bytes: int,
    uri: str,
    kind: str,
    media_type: str,
    created_by: StageRun | None,
) -> Artifact:
    """The Artifact row for these bytes, created on first sight (same bytes, one row).

    Two workers storing the same bytes at once both succeed: the insert ignores a
    conflict on the digest instead of failing one of them.
    """
    artifact = session.get(Artifact, sha256)
    if artifact is not None:
        if artifact.released_at is not None:
            artifact.released_at = None  # the caller stored the bytes again
        return artifact
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    inserted = session.scalars(
        insert(Artifact)
        .values(sha256=sha256, size_bytes=size_bytes, uri=uri, kind=kind, media_type=media_type,
                created_by_run_id=created_by.id if created_by is not None else None, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["sha256"])
        .returning(Artifact)
    ).first()
    return inserted if inserted is not None else session.get_one(Artifact, sha256)


def artifacts_by_digest(session: Session, digests: set[str]) -> dict[str, Artifact]:
    """The Artifact rows among `digests` that exist, in one query."""
    if not digests:
        return {}
    rows = session.scalars(select(Artifact).where(Artifact.sha256.in_(digests))).all()
    return {row.sha256: row for row in rows}


def link_artifact(session: Session, run: StageRun, direction: LinkDirection, name: str,
                  artifact: Artifact) -> None:
    # A plain add: each (run, direction, name) is linked once, and the flush comes with the commit.
    session.add(
        RunArtifact(stage_run_id=run.id, direction=direction, name=name, artifact_sha256=artifact.sha256)
    )


def add_provenance(session: Session, artifact: Artifact, run: StageRun, statement: dict[str, Any]) -> None:
    session.add(Provenance(artifact_sha256=artifact.sha256, stage_run_id=run.id, statement=statement))
    session.flush()


def find_cached_run(session: Session, cache_key: str, exclude_run_id: int | None = None) -> StageRun | None:
    """The earliest succeeded run with this cache key, if any."""
    query = (
        select(StageRun)
        .where(StageRun.cache_key == cache_key, StageRun.status == StageState.SUCCEEDED)
        .order_by(StageRun.id)
        .limit(1)
    )
    if exclude_run_id is not None:
        query = query.where(StageRun.id != exclude_run_id)
    return session.scalar(query)


def claim_run(session: Session, run_id: int, worker_host: str) -> bool:
    """Atomically move a pending or queued run to running; False when another process has it.

    A single conditional UPDATE, so two deliveries of one message never both start it.
    """
    now = utcnow()
    result = session.execute(
        update(StageRun)
        .where(
            StageRun.id == run_id,
            StageRun.status.in_((StageState.PENDING, StageState.QUEUED)),
        )
        .values(status=StageState.RUNNING, worker_host=worker_host, started_at=now, heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    session.flush()
    return bool(result.rowcount)  # type: ignore[attr-defined]


def touch_heartbeat(session: Session, run_id: int) -> bool:
    """Stamp a running run as alive; False when it is no longer running (cancelled or lost)."""
    result = session.execute(
        update(StageRun)
        .where(StageRun.id == run_id, StageRun.status == StageState.RUNNING)
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def lock_cache_key(session: Session, key: str) -> None:
    """Serialize claims of runs with this cache key until the transaction ends (PostgreSQL only).

    SQLite allows one writer at a time already, so there it is a no-op.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": int(key[:15], 16)})


def running_with_key(session: Session, key: str, exclude_run_id: int, heartbeat_after: datetime) -> bool:
    """Whether another run with this cache key is running and alive.

    Alive: it beat since `heartbeat_after`, or it is a parent whose shard children do the
    work (a parent does not beat; the reconciler judges it by its children, and so do we).
    """
    child = aliased(StageRun)
    has_children = select(child.id).where(child.parent_run_id == StageRun.id).exists()
    return (
        session.scalar(
            select(StageRun.id)
            .where(
                StageRun.cache_key == key,
                StageRun.status == StageState.RUNNING,
                StageRun.id != exclude_run_id,
                or_(StageRun.heartbeat_at > heartbeat_after, has_children),
            )
            .limit(1)
        )
        is not None
    )


# --- worker heartbeats -------------------------------------------------------------------------


def worker_started(session: Session, name: str, hostname: str, pid: int, queues: Sequence[str],
                   concurrency: int, memory_limit_mb: int | None = None) -> Worker:
    """Record (or renew, after a restart under the same name) a worker's row."""
    now = utcnow()
    worker = session.get(Worker, name) or Worker(name=name)
    worker.hostname, worker.pid, worker.queues, worker.concurrency = hostname, pid, list(queues), concurrency
    worker.memory_limit_mb = memory_limit_mb
    worker.held_task_ids, worker.started_at, worker.heartbeat_at, worker.stopped_at = [], now, now, None
    session.add(worker)
    session.flush()
    return worker


def worker_beat(session: Session, name: str, held_task_ids: Sequence[str]) -> None:
    """Stamp a worker alive with the task ids it holds now."""
    session.execute(
        update(Worker).where(Worker.name == name)
        .values(heartbeat_at=utcnow(), held_task_ids=list(held_task_ids))
        .execution_options(synchronize_session=False)
    )


def worker_stopped(session: Session, name: str) -> None:
    session.execute(
        update(Worker).where(Worker.name == name)
        .values(stopped_at=utcnow(), held_task_ids=[])
        .execution_options(synchronize_session=False)
    )


def live_workers(session: Session, since: datetime) -> list[Worker]:
    """Workers that beat after `since` and have not stopped."""
    return list(session.scalars(
        select(Worker).where(Worker.heartbeat_at >= since, Worker.stopped_at.is_(None)).order_by(Worker.name)
    ))


def all_workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.name)))
