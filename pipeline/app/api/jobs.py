"""Job routes: list and filter, detail, submit, retry from a stage, cancel.

Each route validates the request, calls the same functions as the CLI (views,
job_control, the launcher) and returns their dicts: the API's JSON shapes are the CLI's
`--json` shapes.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi import Path as PathParam
from pydantic import BaseModel, Field, model_validator
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from pipeline.app import views
from pipeline.app.allocation_diff import allocation_diff
from pipeline.app.api.auth import ApiToken, require_scope
from pipeline.core.states import JobState, StageName
from pipeline.db.models import Job
from pipeline.db.session import session_scope
from pipeline.orchestration.job_control import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    JobRequest,
    cancel_job,
    check_request,
    retry_job,
)
from pipeline.orchestration.launcher import submit_jobs
from pipeline.provenance.statements import redact
from pipeline.stages.sources import SourcePolicy

__all__ = ["router", "owned_job", "JobId"]

router = APIRouter(prefix="/api/jobs", tags=["jobs"])

Reader = Annotated[ApiToken, Depends(require_scope("read"))]
Submitter = Annotated[ApiToken, Depends(require_scope("submit"))]
# Ids are database integers: a larger number is a 422, not an overflow in the driver.
ID_MAX = 2**31 - 1
JobId = Annotated[int, PathParam(ge=1, le=ID_MAX, description="The job's id")]
_MAX_SOURCES = 1000  # jobs one request may submit


class JobSubmission(BaseModel):
    """One or more sources converted with one recipe; `options` are recipe knobs."""

    source: str | None = Field(
        default=None, description="A hub repo `org/name@revision`, a folder or a .gguf"
    )
    sources: list[str] = Field(default_factory=list, max_length=_MAX_SOURCES,
                               description="Several sources, one job each")
    recipe: str | None = Field(
        default=None, description="tq2_0, tq1_0, q2_0 or q1_0 in any case (default: tq2_0, or the target's)"
    )
    target: str | None = Field(
        default=None, description="cpu, cuda, metal or vulkan: picks the default recipe; warns of slow types"
    )
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="Higher runs sooner")
    options: dict[str, Any] = Field(default_factory=dict, description="Job options (`bonsai recipes`)")

    @model_validator(mode="after")
    def _check(self) -> JobSubmission:
        if not self.all_sources():
            raise ValueError("give `source` or a non-empty `sources` list")
        if redact(self.options) != self.options:
            # Job options are stored in the database and shown to every reader.
            raise ValueError(
                "options must not carry secrets (token, password…); the Hugging Face token "
                "belongs in BONSAI_HF_TOKEN on the workers"
            )
        return self

    def all_sources(self) -> list[str]:
        items = ([self.source] if self.source else []) + self.sources
        return [s.strip() for s in items if s and s.strip()]


class RetryRequest(BaseModel):
    from_stage: StageName | None = Field(default=None, description="Default: the first stage not done")
    force: bool = Field(default=False, description="Ignore cached results for the rerun stages")


def _job_or_404(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} does not exist")
    return job


def owned_job(session: Session, job_id: int, token: ApiToken, action: str) -> Job:
    """The job when ``token`` may ``action`` it (its submitter, or an admin token); 404 or 403."""
    job = _job_or_404(session, job_id)
    if not token.may_change(job.submitted_by):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"token {token.name!r} may not {action} job {job_id}: only the token that submitted it or one "
            "with the 'admin' scope may",
        )
    return job


@router.get("", summary="List jobs, newest first")
def list_jobs(
    request: Request,
    _token: Reader,
    status_: Annotated[JobState | None, Query(alias="status")] = None,
    recipe: str | None = None,
    source: Annotated[str | None, Query(description="Substring of the source")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=ID_MAX)] = 0,
) -> list[dict[str, Any]]:
    # One extra query for all the jobs' attempts, not one per job (the page polls this list).
    query = (
        select(Job).options(selectinload(Job.stage_runs)).order_by(Job.id.desc()).limit(limit).offset(offset)
    )
    if status_ is not None:
        query = query.where(Job.status == status_.value)
    if recipe:
        query = query.where(Job.recipe == recipe)
    if source:
        query = query.where(Job.source.contains(source, autoescape=True))
    with session_scope(request.app.state.rt.sessions) as session:
        return [views.job_summary(job) for job in session.scalars(query)]


@router.post("", status_code=status.HTTP_201_CREATED, summary="Submit jobs")
def submit(request: Request, token: Submitter, body: JobSubmission) -> dict[str, list[Any]]:
    options = {**body.options, **({"target": body.target} if body.target is not None else {})}
    # The CLI's check: unknown recipe, option or value is a 400 before anything is recorded.
    requests = [check_request(JobRequest(s, body.recipe, body.priority, options)) for s in body.all_sources()]
    # Hub ids always; local paths only under BONSAI_SOURCE_ROOTS (none by default).
    policy = SourcePolicy.from_roots(request.app.state.settings.source_root_list, allow_any_local=False)
    job_ids = submit_jobs(request.app.state.rt, requests, token.actor, policy, team=token.team_name,
                          may_exceed_priority=token.allows("admin"))
    return {"job_ids": job_ids, "warnings": sorted({w for r in requests for w in r.warnings})}


@router.get("/{job_id}", summary="One job: every attempt of every stage, artifacts, validation")
def detail(
    request: Request,
    _token: Reader,
    job_id: JobId,
    against: Annotated[int | None, Query(ge=1, le=ID_MAX, description=(
        "Another job: adds allocation_diff, the tensors whose auto-allocated types differ from its, "
        "and which way"))] = None,
) -> dict[str, Any]:
    with session_scope(request.app.state.rt.sessions) as session:
        job = _job_or_404(session, job_id)
        # No store: server paths stay private; artifacts download through /api/artifacts.
        found = views.job_detail(job)
        views.add_waiting(found, session, job, request.app.state.rt)
        if against is not None:
            found["allocation_diff"] = allocation_diff(job, _job_or_404(session, against))
        return found


@router.post("/{job_id}/retry", summary="New attempts for a stage and everything after it")
def retry(
    request: Request, token: Submitter, job_id: JobId, body: RetryRequest | None = None
) -> dict[str, Any]:
    body = body or RetryRequest()
    with session_scope(request.app.state.rt.sessions) as session:
        owned_job(session, job_id, token, "retry")
        run_ids = retry_job(session, job_id, body.from_stage, body.force, requested_by=token.actor)
    request.app.state.launcher.start(job_id)
    return {"job_id": job_id, "run_ids": run_ids}


@router.post("/{job_id}/cancel", summary="Stop a job; running tasks are revoked")
def cancel(request: Request, token: Submitter, job_id: JobId) -> dict[str, Any]:
    with session_scope(request.app.state.rt.sessions) as session:
        owned_job(session, job_id, token, "cancel")
        task_ids = cancel_job(session, job_id, cancelled_by=token.actor)
    request.app.state.launcher.revoke(task_ids)
    return {"job_id": job_id, "status": JobState.CANCELLED.value, "revoked": len(task_ids)}
