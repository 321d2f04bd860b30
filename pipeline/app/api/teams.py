"""Teams route: GET /api/teams, what each team holds of the service, its share, usage, caps and quota."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from pipeline.app.api.auth import ApiToken, require_scope
from pipeline.app.views import team_rows
from pipeline.db.session import session_scope

__all__ = ["router"]

router = APIRouter(prefix="/api", tags=["teams"])

Reader = Annotated[ApiToken, Depends(require_scope("read"))]


@router.get("/teams", summary="Per team: running, waiting, share, decayed usage, caps and quota used")
def list_teams(request: Request, _token: Reader) -> list[dict[str, Any]]:
    rt = request.app.state.rt
    with session_scope(rt.sessions) as session:
        return team_rows(session, rt.teams)
