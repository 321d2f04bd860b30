"""What keeps stored bytes from `bonsai gc`: the store lease, and pins.

The lease makes gc safe beside running jobs. Whoever is about to link stored bytes to a run
(a stage's outputs stored, an earlier run's outputs reused) holds it shared until its
transaction commits; gc holds it exclusively while it picks what to remove and removes it.
So gc either sees those links and keeps the bytes, or it finished first and the job, finding
the bytes gone, stores them again.
"""

from __future__ import annotations

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from pipeline.core.errors import InputError
from pipeline.db import actions
from pipeline.db.models import Artifact, Pin

__all__ = ["hold_store_shared", "hold_store_exclusive", "PIN", "PUBLISHED", "pin", "unpin", "pins_of"]

# PostgreSQL advisory lock key of the store lease (cache-key locks use non-negative keys).
_LEASE_KEY = -0x626F6E7361690001
PIN, PUBLISHED = "pin", "published"


def hold_store_shared(session: Session) -> None:
    """Until this transaction ends, gc removes nothing (other holders of the shared lease go on)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": _LEASE_KEY})
    else:
        _take_sqlite_write_lock(session)


def hold_store_exclusive(session: Session) -> None:
    """Until this transaction ends, nobody links stored bytes to a run (gc's side of the lease)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LEASE_KEY})
    else:
        _take_sqlite_write_lock(session)


def _take_sqlite_write_lock(session: Session) -> None:
    # SQLite has one writer at a time: a write that changes nothing still takes the database's write
    # lock, held to the end of the transaction. Coarser than a lease, and enough for one machine.
    session.execute(text("UPDATE artifacts SET sha256 = sha256 WHERE 1 = 0"))


def pin(session: Session, artifact: Artifact, reason: str, note: str) -> bool:
    """Hold `artifact`'s bytes (`reason` PIN or PUBLISHED, `note` who or where); False if already so.

    InputError when gc removed them already: a pin would hold nothing."""
    if reason not in (PIN, PUBLISHED):
        raise InputError(f"pin reason {reason!r} is neither {PIN!r} nor {PUBLISHED!r}")
    if artifact.released_at is not None:
        raise InputError(f"artifact {artifact.sha256[:12]}: `bonsai gc` removed its bytes already; rerun the "
                         "stage that made it (`bonsai retry JOB --from STAGE`), then pin what it makes")
    note = note[:1024]
    exists = session.scalar(select(Pin.id).where(
        Pin.artifact_sha256 == artifact.sha256, Pin.reason == reason, Pin.note == note))
    if exists is not None:
        return False
    session.add(Pin(artifact_sha256=artifact.sha256, reason=reason, note=note))
    session.flush()
    if reason == PIN:  # a publication records its own action
        actions.record(session, note, "pin", artifact.sha256)
    return True


def unpin(session: Session, artifact: Artifact, actor: str | None = None) -> int:
    """Drop the hand-made pins of `artifact` (publications stay recorded); how many were dropped.
    ``actor``: who asked, for the account."""
    result = session.execute(delete(Pin).where(Pin.artifact_sha256 == artifact.sha256, Pin.reason == PIN))
    dropped = int(getattr(result, "rowcount", 0) or 0)
    actions.record(session, actor, "unpin", artifact.sha256, detail={"dropped": dropped})
    return dropped


def pins_of(session: Session, sha256: str) -> list[Pin]:
    return list(session.scalars(select(Pin).where(Pin.artifact_sha256 == sha256).order_by(Pin.id)))
