"""The data model: jobs, one stage-run row per attempt, artifacts, links, provenance.

Rows are only ever added; an attempt that failed stays as it was when a new attempt
is made. Status columns are written by `pipeline.db.repo` alone.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, validates

from pipeline.core.states import JobState, LinkDirection, StageName, StageState

__all__ = [
    "Base", "Job", "StageRun", "Artifact", "RunArtifact", "Provenance", "Pin", "Worker", "Action", "utcnow",
    "as_utc",
]


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """A stored time as an aware UTC one (SQLite hands back naive datetimes of what was stored as UTC)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _vocabulary(kind: type[StrEnum], length: int) -> Enum:
    """A fixed vocabulary stored as its values in a VARCHAR of ``length``: rows load as ``kind``'s
    members, and an unknown value is refused on write. No database enum type and no CHECK: the
    schema is what the migrations made."""
    return Enum(kind, native_enum=False, create_constraint=False, length=length, validate_strings=True,
                values_callable=lambda members: [member.value for member in members])


class Base(DeclarativeBase):
    type_annotation_map = {
        dict[str, Any]: JSON,
        list[str]: JSON,
        datetime: DateTime(timezone=True),
    }


class Job(Base):
    """What was asked for: a source, a recipe and its parameters."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(2048))
    resolved_revision: Mapped[str | None] = mapped_column(String(64))
    recipe: Mapped[str] = mapped_column(String(64))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[JobState] = mapped_column(_vocabulary(JobState, 16), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    submitted_by: Mapped[str | None] = mapped_column(String(256))
    # The submitter's team (`core.teams`): fair share, caps and quotas count by it.
    team: Mapped[str] = mapped_column(String(256), index=True, server_default="unknown")
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    stage_runs: Mapped[list[StageRun]] = relationship(
        back_populates="job", order_by="StageRun.id", cascade="all, delete-orphan"
    )

    @validates("status")
    def _job_state(self, _key: str, value: str) -> JobState:
        return JobState(value)  # a row built in memory holds members too, as a loaded one does


class StageRun(Base):
    """One attempt at one stage of one job."""

    __tablename__ = "stage_runs"
    __table_args__ = (
        UniqueConstraint("job_id", "stage", "shard", "attempt", name="uq_stage_runs_job_stage_shard_attempt"),
        Index("ix_stage_runs_status", "status"),
        Index("ix_stage_runs_cache_key", "cache_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    stage: Mapped[StageName] = mapped_column(_vocabulary(StageName, 32))
    # Fan-out: a child run works on one source shard for its parent run ("" = not a child).
    shard: Mapped[str] = mapped_column(String(512), default="", server_default="")
    parent_run_id: Mapped[int | None] = mapped_column(ForeignKey("stage_runs.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[StageState] = mapped_column(_vocabulary(StageState, 16))
    worker_host: Mapped[str | None] = mapped_column(String(256))
    device: Mapped[str | None] = mapped_column(String(64))
    task_id: Mapped[str | None] = mapped_column(String(64))
    cache_key: Mapped[str | None] = mapped_column(String(64))
    # For skipped-cached runs: the run whose outputs were reused.
    cached_from_id: Mapped[int | None] = mapped_column(ForeignKey("stage_runs.id"))
    # The failed attempt this one retries. Unique: one lost or failed attempt gets exactly one
    # retry, however many reconcilers or workers decide on it at once.
    retry_of_id: Mapped[int | None] = mapped_column(ForeignKey("stage_runs.id"), unique=True)
    # Set by `retry --force`: this attempt must not reuse a cached result.
    is_forced: Mapped[bool] = mapped_column(Boolean, default=False)
    # Who asked for this attempt by hand (`retry`: "api:<token name>", "cli"); None: the job's own course.
    requested_by: Mapped[str | None] = mapped_column(String(256))
    error_kind: Mapped[str | None] = mapped_column(String(16))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_traceback: Mapped[str | None] = mapped_column(Text)
    # What the attempt logged (pipeline.* records of its thread, INFO and up; the tail when long).
    log_text: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    warnings: Mapped[list[str]] = mapped_column(default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Distributed mode: when its inputs were done. A pending attempt with this set waits in the database
    # for a slot of its queue (`orchestration.admission`); queued means sent.
    ready_at: Mapped[datetime | None]
    queued_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    job: Mapped[Job] = relationship(back_populates="stage_runs")
    links: Mapped[list[RunArtifact]] = relationship(
        back_populates="stage_run", order_by="RunArtifact.name", cascade="all, delete-orphan"
    )

    @validates("stage", "status")
    def _vocabularies(self, key: str, value: str) -> StageName | StageState:
        return StageName(value) if key == "stage" else StageState(value)

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class Artifact(Base):
    """One stored file, addressed by its content hash."""

    __tablename__ = "artifacts"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    uri: Mapped[str] = mapped_column(String(2048))
    media_type: Mapped[str] = mapped_column(String(128))
    created_by_run_id: Mapped[int | None] = mapped_column(ForeignKey("stage_runs.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When `bonsai gc` removed the bytes (the row, digest and provenance stay); None while they are kept.
    # Storing the same bytes again clears it.
    released_at: Mapped[datetime | None]


class Pin(Base):
    """Bytes `bonsai gc` must keep: pinned by hand (`bonsai pin`), or a GGUF that was published."""

    __tablename__ = "pins"
    __table_args__ = (
        UniqueConstraint("artifact_sha256", "reason", "note", name="uq_pins_artifact_reason_note"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    artifact_sha256: Mapped[str] = mapped_column(ForeignKey("artifacts.sha256"), index=True)
    # "pin" (by hand) or "published" (held only by `gc --keep-published`).
    reason: Mapped[str] = mapped_column(String(16))
    # Who pinned it, or where it was published.
    note: Mapped[str] = mapped_column(String(1024), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RunArtifact(Base):
    """A stage run read (`in`) or wrote (`out`) an artifact under a logical name."""

    __tablename__ = "run_artifacts"

    stage_run_id: Mapped[int] = mapped_column(
        ForeignKey("stage_runs.id", ondelete="CASCADE"), primary_key=True
    )
    direction: Mapped[LinkDirection] = mapped_column(_vocabulary(LinkDirection, 3), primary_key=True)
    name: Mapped[str] = mapped_column(String(1024), primary_key=True)
    artifact_sha256: Mapped[str] = mapped_column(ForeignKey("artifacts.sha256"), index=True)

    stage_run: Mapped[StageRun] = relationship(back_populates="links")
    artifact: Mapped[Artifact] = relationship()

    @validates("direction")
    def _direction(self, _key: str, value: str) -> LinkDirection:
        return LinkDirection(value)


class Provenance(Base):
    """An in-toto Statement about one output artifact of one stage run."""

    __tablename__ = "provenance"
    __table_args__ = (
        UniqueConstraint("artifact_sha256", "stage_run_id", name="uq_provenance_artifact_run"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    artifact_sha256: Mapped[str] = mapped_column(ForeignKey("artifacts.sha256"), index=True)
    stage_run_id: Mapped[int] = mapped_column(ForeignKey("stage_runs.id", ondelete="CASCADE"))
    statement: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Worker(Base):
    """A live (or last seen) worker process: its queues and the task ids it holds, stamped often.

    The reconciler trusts a message held in the broker's unacked set only while the worker
    that holds it keeps beating here; `bonsai workers` lists these rows.
    """

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(256))
    pid: Mapped[int] = mapped_column(Integer)
    queues: Mapped[list[str]] = mapped_column(default=list)
    concurrency: Mapped[int] = mapped_column(Integer, default=1)
    # BONSAI_WORKER_MEMORY_MB of this worker; None: no cap (it takes a stage of any size).
    memory_limit_mb: Mapped[int | None] = mapped_column(Integer)
    held_task_ids: Mapped[list[str]] = mapped_column(default=list)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[datetime | None]


class Action(Base):
    """One state-changing action someone took, as `sacct` keeps them: written once, never rewritten.

    ``action``: submit, cancel, retry, publish, pin, unpin, gc, refused. ``target``: what it acted on
    ("job 3", an artifact's sha256, "store"). ``outcome``: "ok", or why it was refused or failed.
    ``team``: the actor's team (an actor that names none is a team of its own).
    """

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(256), index=True)
    team: Mapped[str] = mapped_column(String(256))
    action: Mapped[str] = mapped_column(String(16), index=True)
    target: Mapped[str] = mapped_column(String(256))
    job_id: Mapped[int | None] = mapped_column(Integer, index=True)
    outcome: Mapped[str] = mapped_column(String(1024), default="ok")
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
