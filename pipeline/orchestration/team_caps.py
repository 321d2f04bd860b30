"""A team's caps on what it submits, checked before any row is recorded: its priority ceiling, its
unfinished jobs (``max_pending``) and its storage quota. Over a cap the submission is refused whole."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from pipeline.core.errors import InputError, OverCap
from pipeline.core.teams import TeamPolicy
from pipeline.db import team_usage

__all__ = ["check_submission", "PENDING_RETRY_AFTER_S", "QUOTA_RETRY_AFTER_S"]

# When to ask again: a queued job of an ordinary model finishes in minutes; stored bytes leave only when
# someone collects them.
PENDING_RETRY_AFTER_S = 60
QUOTA_RETRY_AFTER_S = 600


def check_submission(session: Session, team: str, policy: TeamPolicy, priorities: Sequence[int],
                     may_exceed_priority: bool = False) -> None:
    """Refuse ``len(priorities)`` new jobs of ``team``: InputError above the priority ceiling (without the
    admin scope), OverCap over ``max_pending`` or the storage quota."""
    if not priorities:
        return
    ceiling = policy.max_priority
    if ceiling is not None and not may_exceed_priority and max(priorities) > ceiling:
        raise InputError(f"priority {max(priorities)} is above team {team}'s ceiling, max_priority "
                         f"{ceiling}; submit at {ceiling} or less, or with a token of the 'admin' scope")
    if policy.max_pending is not None:
        unfinished = team_usage.unfinished_jobs(session, team)
        if unfinished + len(priorities) > policy.max_pending:
            raise OverCap(f"team {team} is at its cap max_pending {policy.max_pending}: it has {unfinished} "
                          f"unfinished job(s), and {len(priorities)} more would pass it; submit again when "
                          "some have finished (or cancel some)", PENDING_RETRY_AFTER_S)
    if policy.storage_quota_bytes is not None:
        stored = team_usage.stored_bytes(session, team)
        if stored >= policy.storage_quota_bytes:
            raise OverCap(f"team {team} is at its storage quota: its jobs stored {_size(stored)} of "
                          f"{_size(policy.storage_quota_bytes)}; free space with `bonsai gc` (unpin what you "
                          "no longer need first), then submit again", QUOTA_RETRY_AFTER_S)


def _size(count: int) -> str:
    return f"{count / 1024**3:.2f} GB" if count >= 1024**3 else f"{count / 1024**2:.1f} MB"
