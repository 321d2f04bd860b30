"""Store route: POST /api/store/gc removes stored bytes nothing can still read (admin tokens only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from pipeline.app.api.auth import ApiToken, require_scope
from pipeline.db.session import session_scope

__all__ = ["router"]

router = APIRouter(prefix="/api/store", tags=["store"])

Admin = Annotated[ApiToken, Depends(require_scope("admin"))]


class GcRequest(BaseModel):
    older_than: str | None = Field(default=None, max_length=16,
                                   description="Only bytes unused for this long: 90s, 45m, 12h, 7d, 2w")
    keep_published: bool = Field(default=False, description="Keep the GGUFs of published jobs")
    dry_run: bool = Field(default=False, description="Say what would be removed; remove nothing")


@router.post("/gc", summary="Remove stored bytes no unfinished job reads and no pin holds (admin)")
def gc(request: Request, token: Admin, body: GcRequest) -> dict[str, Any]:
    from pipeline.orchestration.store_gc import GcRules, collect_garbage

    rules = GcRules.asked(body.older_than, body.keep_published, body.dry_run)
    rt = request.app.state.rt
    with session_scope(rt.sessions) as session:
        report = collect_garbage(session, rt.store, rules, token.actor)
    return report.as_dict()
