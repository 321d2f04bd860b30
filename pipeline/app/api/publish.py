"""Publish route: POST /api/jobs/{id}/publish writes a job's bundle to a folder or an s3:// prefix."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from pipeline.app.api.auth import ApiToken, require_scope
from pipeline.app.api.jobs import JobId, owned_job
from pipeline.db.session import session_scope

__all__ = ["router"]

router = APIRouter(prefix="/api/jobs", tags=["jobs"])

Submitter = Annotated[ApiToken, Depends(require_scope("submit"))]


class PublishRequest(BaseModel):
    to: str = Field(max_length=1024, description="A new folder under BONSAI_PUBLISH_ROOTS, or an "
                    "s3://bucket/prefix under BONSAI_PUBLISH_BUCKETS")
    split_max_size: str | None = Field(default=None, max_length=32, description="Split the GGUF: 2G, 500M, …")
    force: bool = Field(default=False, description="Publish even though validation failed")


@router.post("/{job_id}/publish", summary="Write the job's bundle (GGUF, card, SHA256SUMS, provenance)")
def publish(request: Request, token: Submitter, job_id: JobId, body: PublishRequest) -> dict[str, Any]:
    from pipeline.app.publishing import publish_job
    from pipeline.publish import parse_size
    from pipeline.publish.destinations import PublishPolicy

    rt, settings = request.app.state.rt, request.app.state.settings
    with session_scope(rt.sessions) as session:
        owned_job(session, job_id, token, "publish")
    # Only where the operator allows (BONSAI_PUBLISH_ROOTS / BONSAI_PUBLISH_BUCKETS); none: refused.
    to = PublishPolicy.from_settings(settings.publish_root_list, settings.publish_bucket_list).check(body.to)
    client = None
    if to.startswith("s3://"):
        from pipeline.artifacts.s3 import make_s3_client

        client = make_s3_client(settings.s3_endpoint_url)
    max_bytes = parse_size(body.split_max_size) if body.split_max_size else None
    with session_scope(rt.sessions) as session:
        bundle, where = publish_job(session, rt.store, job_id, to, split_max_bytes=max_bytes,
                                    is_forced=body.force, s3_client=client, actor=token.actor)
    return {"job_id": job_id, "to": where, "files": dict(bundle.files), "gguf_files": list(bundle.gguf_files),
            "is_split": bundle.is_split}
