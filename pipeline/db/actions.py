"""The account of every state-changing action (`models.Action`): one row each, written once, never
rewritten, as Slurm's `sacct` keeps them. The functions that change state record their own row in the
caller's transaction, so an action that rolls back leaves no row and a kept one always has its row.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.core.errors import InputError
from pipeline.core.teams import UNKNOWN, team_of
from pipeline.db.models import Action

__all__ = ["ACTIONS", "record", "history", "UNKNOWN_ACTOR"]

ACTIONS = ("submit", "cancel", "retry", "publish", "pin", "unpin", "gc", "refused")
UNKNOWN_ACTOR = UNKNOWN


def record(session: Session, actor: str | None, action: str, target: str, *, job_id: int | None = None,
           outcome: str = "ok", detail: dict[str, Any] | None = None, team: str | None = None) -> Action:
    """Add the row of one action; ``team`` defaults to the actor's own."""
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
    who = (actor or UNKNOWN_ACTOR)[:256]
    row = Action(actor=who, team=team_of(who, team), action=action, target=target[:256], job_id=job_id,
                 outcome=outcome[:1024], detail=detail or {})
    session.add(row)
    session.flush()
    return row


def history(session: Session, *, job_id: int | None = None, actor: str | None = None,
            action: str | None = None, since: datetime | None = None, limit: int = 1000) -> list[Action]:
    """The account, oldest first, filtered by job, actor, action and time (at or after ``since``).
    InputError for an ``action`` that is none of `ACTIONS`."""
    if action is not None and action not in ACTIONS:
        raise InputError(f"action {action!r} is not an action; expected one of {', '.join(ACTIONS)}")
    query = select(Action).order_by(Action.id)
    if job_id is not None:
        query = query.where(Action.job_id == job_id)
    if actor is not None:
        query = query.where(Action.actor == actor)
    if action is not None:
        query = query.where(Action.action == action)
    if since is not None:
        query = query.where(Action.at >= since)
    return list(session.scalars(query.limit(limit)))
