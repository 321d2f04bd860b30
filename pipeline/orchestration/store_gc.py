"""`bonsai gc`: remove stored bytes nothing can still read, keeping every row, digest and statement.

Kept, whatever the rules:
- bytes linked to any run of a job that is pending, running or failed (a failed job can be
  retried, and its retry reads them; cancel it to let them go);
- bytes pinned by hand (`bonsai pin`), and a published GGUF when ``keep_published``;
- signature envelopes (they are provenance);
- with ``older_than``, bytes written or read by a run that ended within that time.

The rest go: the store deletes them and their artifact row records ``released_at``, so
`bonsai audit` says "bytes not retained" for them. A job that later needs the same bytes
makes them again (a reused result whose bytes are gone is recomputed).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session, sessionmaker

from pipeline.artifacts.store import ArtifactStore
from pipeline.core.errors import InputError
from pipeline.core.option_fields import read_fields
from pipeline.core.states import JobState, LinkDirection, StageName
from pipeline.db import actions, retention
from pipeline.db.models import Artifact, Job, Pin, RunArtifact, StageRun, utcnow
from pipeline.db.session import session_scope
from pipeline.provenance.signing import ENVELOPE_KIND
from pipeline.stages.options import JobOptions

__all__ = ["GcRules", "GcReport", "collect_garbage", "release_source", "source_digests", "parse_age"]

log = logging.getLogger(__name__)

# A job in one of these states may still read what its runs linked.
_READING_JOBS = (JobState.PENDING, JobState.RUNNING, JobState.FAILED)
_AGE = re.compile(r"^\s*(\d{1,6})\s*([smhdw])\s*$")
_AGE_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta:
    """``90s``, ``45m``, ``12h``, ``7d``, ``2w`` as a timedelta; InputError otherwise."""
    found = _AGE.match(text)
    if found is None:
        raise InputError(f"age {text[:40]!r} is not a number and a unit; "
                         "write it like 90s, 45m, 12h, 7d or 2w")
    return timedelta(seconds=int(found.group(1)) * _AGE_UNIT_S[found.group(2)])


@dataclass(frozen=True)
class GcRules:
    """What `collect_garbage` may take. ``only``: consider just these digests (a job's source copy)."""

    older_than: timedelta | None = None
    keep_published: bool = False
    dry_run: bool = False
    only: frozenset[str] | None = None

    @classmethod
    def asked(cls, older_than: str | None, keep_published: bool, dry_run: bool) -> GcRules:
        """The rules a user asked for (CLI flags, the API's body); ``older_than`` as `parse_age` reads it."""
        return cls(parse_age(older_than) if older_than else None, keep_published, dry_run)


@dataclass
class GcReport:
    """What was removed (or would be, on a dry run) and why the rest stayed."""

    dry_run: bool
    removed: list[tuple[str, int]] = field(default_factory=list)  # (sha256, bytes)
    kept: dict[str, int] = field(default_factory=dict)  # reason -> artifacts

    @property
    def removed_bytes(self) -> int:
        return sum(size for _sha, size in self.removed)

    def as_dict(self) -> dict[str, object]:
        return {"dry_run": self.dry_run, "removed": len(self.removed), "removed_bytes": self.removed_bytes,
                "removed_sha256": [sha for sha, _size in self.removed], "kept": dict(self.kept)}


def collect_garbage(session: Session, store: ArtifactStore, rules: GcRules, actor: str | None = None,
                    job_id: int | None = None) -> GcReport:
    """Remove what `rules` allow (see the module docstring), in the caller's transaction.

    Holds the store lease exclusively (unless a dry run), so no job links bytes meanwhile: commit
    soon after. Bytes the store no longer has are recorded as released all the same. A run that may
    remove bytes is one row of the action account (``actor``; ``job_id`` for one job's source copy).
    """
    if not rules.dry_run:
        retention.hold_store_exclusive(session)
    now = utcnow()
    holds = _holds(rules, now)
    retained = select(Artifact.sha256).where(Artifact.released_at.is_(None))
    if rules.only is not None:
        retained = retained.where(Artifact.sha256.in_(rules.only))
    report = GcReport(dry_run=rules.dry_run)
    held: set[str] = set()
    for reason, query in holds.items():
        found = set(session.scalars(retained.where(Artifact.sha256.in_(query))))
        report.kept[reason] = len(found - held)
        held |= found
    oldest_first = select(Artifact).where(Artifact.sha256.in_(retained)).order_by(Artifact.created_at)
    candidates = session.scalars(oldest_first).all()
    for artifact in candidates:
        if artifact.sha256 in held:
            continue
        if not rules.dry_run:
            store.remove(artifact.sha256)
            artifact.released_at = now
        report.removed.append((artifact.sha256, int(artifact.size_bytes)))
    if report.removed and not rules.dry_run:
        log.info("gc: removed %d artifacts (%d bytes)", len(report.removed), report.removed_bytes)
    if not rules.dry_run:
        actions.record(session, actor, "gc", f"job {job_id} source" if job_id is not None else "store",
                       job_id=job_id, detail={"removed": len(report.removed),
                                              "removed_bytes": report.removed_bytes})
    return report


def _holds(rules: GcRules, now: datetime) -> dict[str, Select[str]]:
    """Each reason to keep bytes, as a query of the digests it holds."""
    linked = select(RunArtifact.artifact_sha256).join(StageRun, StageRun.id == RunArtifact.stage_run_id)
    holds: dict[str, Select[str]] = {
        "unfinished job": linked.join(Job, Job.id == StageRun.job_id).where(Job.status.in_(_READING_JOBS)),
        "pinned": select(Pin.artifact_sha256).where(Pin.reason == retention.PIN),
        "signature": select(Artifact.sha256).where(Artifact.kind == ENVELOPE_KIND),
    }
    if rules.keep_published:
        holds["published"] = select(Pin.artifact_sha256).where(Pin.reason == retention.PUBLISHED)
    if rules.older_than is not None:
        cutoff = now - rules.older_than
        used = func.coalesce(StageRun.finished_at, StageRun.created_at)
        recent_links = linked.where(used > cutoff)
        holds["recent"] = select(Artifact.sha256).where(
            (Artifact.created_at > cutoff) | Artifact.sha256.in_(recent_links))
    return holds


def source_digests(session: Session, job_id: int) -> frozenset[str]:
    """The digests of the source copy `job_id`'s download stage stored (or reused)."""
    return frozenset(session.scalars(
        select(RunArtifact.artifact_sha256).join(StageRun, StageRun.id == RunArtifact.stage_run_id)
        .where(StageRun.job_id == job_id, StageRun.stage == StageName.DOWNLOAD,
               RunArtifact.direction == LinkDirection.OUT)))


def release_source(sessions: sessionmaker[Session], store: ArtifactStore, job_id: int) -> GcReport | None:
    """After `job_id` succeeded with ``keep_source=false``: remove its source copy unless something
    else holds it (another unfinished job on the same source, a pin). None when the job keeps it.

    Never raises: the job has succeeded already, and what could not be removed now `bonsai gc` takes later.
    """
    try:
        with session_scope(sessions) as session:
            job = session.get_one(Job, job_id)
            if job.status is not JobState.SUCCEEDED:
                return None
            if JobOptions(**read_fields(JobOptions, job.params or {}, "job")).keep_source:
                return None
            report = collect_garbage(session, store, GcRules(only=source_digests(session, job_id)),
                                     "keep_source=false", job_id)
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("job %s: could not remove its source copy (keep_source=false); `bonsai gc` will",
                    job_id, exc_info=True)
        return None
    log.info("job %s: keep_source=false: removed %d source files (%d bytes)", job_id, len(report.removed),
             report.removed_bytes)
    return report

