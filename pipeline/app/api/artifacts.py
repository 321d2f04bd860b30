"""Artifact routes: metadata, streamed download, provenance statements, the checked chain."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.responses import FileResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.app.api.auth import ApiToken, require_scope
from pipeline.artifacts.store import shareable_uri
from pipeline.core.errors import InputError
from pipeline.db import retention
from pipeline.db.models import Artifact, Provenance, RunArtifact
from pipeline.db.session import session_scope
from pipeline.provenance.audit import audit_artifact, resolve_artifact

__all__ = ["router"]

router = APIRouter(prefix="/api/artifacts", tags=["artifacts"])

Reader = Annotated[ApiToken, Depends(require_scope("read"))]
Admin = Annotated[ApiToken, Depends(require_scope("admin"))]


def _artifact_or_404(session: Session, ref: str) -> Artifact:
    try:
        return resolve_artifact(session, ref)
    except InputError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc


def _links(session: Session, sha256: str) -> list[dict[str, Any]]:
    links = session.scalars(select(RunArtifact).where(RunArtifact.artifact_sha256 == sha256)).all()
    return [
        {
            "job_id": link.stage_run.job_id,
            "stage": link.stage_run.stage,
            "stage_run_id": link.stage_run_id,
            "direction": link.direction,
            "name": link.name,
        }
        for link in links
    ]


@router.get("/{ref}", summary="An artifact's record and the runs that wrote or read it")
def artifact(request: Request, _token: Reader, ref: str) -> dict[str, Any]:
    with session_scope(request.app.state.rt.sessions) as session:
        item = _artifact_or_404(session, ref)
        return {
            "sha256": item.sha256,
            "kind": item.kind,
            "size_bytes": item.size_bytes,
            "media_type": item.media_type,
            "uri": shareable_uri(item.uri, item.sha256),
            "created_by_run_id": item.created_by_run_id,
            "created_at": item.created_at.isoformat(),
            "released_at": item.released_at.isoformat() if item.released_at else None,
            "pins": [{"reason": p.reason, "note": p.note, "created_at": p.created_at.isoformat()}
                     for p in retention.pins_of(session, item.sha256)],
            "links": _links(session, item.sha256),
        }


@router.get("/{ref}/download", summary="The artifact's bytes, streamed", response_class=FileResponse)
def download(request: Request, _token: Reader, ref: str) -> FileResponse:
    store = request.app.state.rt.store
    with session_scope(request.app.state.rt.sessions) as session:
        item = _artifact_or_404(session, ref)
        name = session.scalar(
            select(RunArtifact.name)
            .where(RunArtifact.artifact_sha256 == item.sha256)
            .order_by(RunArtifact.stage_run_id)
            .limit(1)
        )
        media_type = item.media_type
    is_stored = store.has(item.sha256)
    if item.released_at is not None and not is_stored:
        raise HTTPException(status.HTTP_410_GONE, f"artifact {item.sha256}: bytes not retained "
                            f"(`bonsai gc` removed them on {item.released_at:%Y-%m-%d %H:%M} UTC); "
                            "rerun the stage that made it")
    if not is_stored:
        raise HTTPException(status.HTTP_410_GONE, f"artifact {item.sha256} is recorded but not in the store")
    filename = (name or item.sha256).rsplit("/", 1)[-1]
    return FileResponse(
        store.path(item.sha256),
        media_type=media_type,
        filename=filename,
        headers={"X-Content-SHA256": item.sha256},
    )


@router.get("/{ref}/provenance", summary="The in-toto statements about the artifact (and DSSE envelopes)")
def provenance(request: Request, _token: Reader, ref: str) -> dict[str, Any]:
    from pipeline.provenance.signing import envelopes_for

    rt = request.app.state.rt
    with session_scope(rt.sessions) as session:
        item = _artifact_or_404(session, ref)
        rows = session.scalars(
            select(Provenance).where(Provenance.artifact_sha256 == item.sha256).order_by(Provenance.id)
        ).all()
        statements = [
            {
                "id": row.id,
                "stage_run_id": row.stage_run_id,
                "statement": row.statement,
                "envelopes": [e.envelope for e in envelopes_for(session, rt.store, row)],
            }
            for row in rows
        ]
    return {"sha256": item.sha256, "statements": statements}


@router.get("/{ref}/chain", summary="The provenance chain down to the source files, checked")
def chain(
    request: Request,
    _token: Reader,
    ref: str,
    verify: Annotated[bool, Query(description="Also re-hash every file (reads all the bytes)")] = False,
) -> dict[str, Any]:
    rt = request.app.state.rt
    with session_scope(rt.sessions) as session:
        item = _artifact_or_404(session, ref)
        report = audit_artifact(
            session, rt.store, item.sha256, rehash=verify, public_key=request.app.state.public_key
        )
    return report.as_dict()


@router.post("/{ref}/pin", summary="Keep the artifact's bytes whatever gc is told (admin)")
def pin(request: Request, token: Admin, ref: str) -> dict[str, Any]:
    with session_scope(request.app.state.rt.sessions) as session:
        item = _artifact_or_404(session, ref)
        try:
            is_new = retention.pin(session, item, retention.PIN, token.actor)
        except InputError as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
        return {"sha256": item.sha256, "pinned": True, "was_pinned": not is_new}


@router.delete("/{ref}/pin", summary="Let gc take the artifact's bytes again (admin)")
def unpin(request: Request, token: Admin, ref: str) -> dict[str, Any]:
    with session_scope(request.app.state.rt.sessions) as session:
        item = _artifact_or_404(session, ref)
        dropped = retention.unpin(session, item, token.actor)
        return {"sha256": item.sha256, "pinned": False, "was_pinned": dropped > 0}
