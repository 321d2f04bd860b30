"""History route: GET /api/history, the account of every state-changing action (read tokens)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from pipeline.app.api.auth import ApiToken, require_scope
from pipeline.app.api.jobs import ID_MAX
from pipeline.app.views import action_rows, history_since
from pipeline.db.actions import ACTIONS, history
from pipeline.db.session import session_scope

__all__ = ["router"]

router = APIRouter(prefix="/api", tags=["history"])

Reader = Annotated[ApiToken, Depends(require_scope("read"))]


@router.get("/history", summary="Who did what, when, to which job or artifact, and how it ended")
def list_history(
    request: Request,
    _token: Reader,
    job: Annotated[int | None, Query(ge=1, le=ID_MAX, description="Only this job's actions")] = None,
    actor: Annotated[str | None, Query(max_length=256, description="Only this actor's actions")] = None,
    action: Annotated[str | None, Query(max_length=16, description=f"One of {', '.join(ACTIONS)}")] = None,
    since: Annotated[str | None, Query(max_length=40, description="ISO 8601: at or after")] = None,
) -> list[dict[str, Any]]:
    """A bad ``action`` or ``since`` is an InputError: the app answers 400 naming it."""
    moment = history_since(since)
    with session_scope(request.app.state.rt.sessions) as session:
        return action_rows(history(session, job_id=job, actor=actor, action=action, since=moment))
