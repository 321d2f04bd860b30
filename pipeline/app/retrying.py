"""What `bonsai retry` says: which new attempts will run, and which were served from the cache.

An attempt whose stage, stage version, parameters and input digests equal an earlier
succeeded one is recorded as `skipped-cached` and computes nothing; saying "2 new attempts"
and nothing else hides that. These lines name them, the attempt they reused, and `--force`.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from pipeline.core.states import StageState
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.runtime import Runtime

__all__ = ["planned_lines", "outcome_lines"]


def _runs(rt: Runtime, run_ids: Sequence[int]) -> list[StageRun]:
    with session_scope(rt.sessions) as session:
        runs = list(session.scalars(select(StageRun).where(StageRun.id.in_(run_ids)).order_by(StageRun.id)))
        session.expunge_all()
        return runs


def planned_lines(job_id: int, stages: Sequence[str], force: bool) -> list[str]:
    """Before the run: what was recorded, and what the cache will do with it."""
    listed = ", ".join(stages)
    first = f"job {job_id}: {len(stages)} new attempt(s): {listed}"
    if force:
        return [first, "  --force: each is computed again, even where an equal earlier result exists"]
    return [first, "  an attempt whose inputs and parameters equal an earlier one's is served from the cache "
                   "(skipped-cached); add --force to compute them again"]


def outcome_lines(rt: Runtime, job_id: int, run_ids: Sequence[int], from_stage: str | None) -> list[str]:
    """After an in-process run: which of the new attempts computed and which reused a result."""
    runs = _runs(rt, run_ids)
    cached = [run for run in runs if run.status == StageState.SKIPPED_CACHED]
    if not cached:
        return []
    reused = ", ".join(f"{run.stage} (result of run {run.cached_from_id})" for run in cached)
    lines = [f"job {job_id}: served from the cache, nothing recomputed: {reused}"]
    if len(cached) == len(runs):
        again = f"--from {from_stage} " if from_stage else ""
        lines.append(f"  to compute them again: bonsai retry {job_id} {again}--force")
    return lines
