"""Submit jobs in distributed mode: record them, then dispatch each one's first stage."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.core.settings import Settings
from pipeline.db.session import session_scope
from pipeline.orchestration.distributed.dispatch import advance
from pipeline.orchestration.execution import Runtime
from pipeline.orchestration.job_control import JobRequest, create_jobs

__all__ = ["submit_jobs"]


def submit_jobs(rt: Runtime, settings: Settings, requests: Sequence[JobRequest],
                submitted_by: str | None = "cli:submit") -> list[int]:
    """Record every job first (one transaction), then send their first stages.

    A crash between the two leaves pending jobs that the reconciler dispatches.
    """
    with session_scope(rt.sessions) as session:
        job_ids = create_jobs(session, requests, submitted_by)
    for job_id in job_ids:
        advance(rt.sessions, settings, job_id)
    return job_ids
