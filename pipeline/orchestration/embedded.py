"""Embedded mode: run a job's stages one after another in this process.

The loop asks `advance_job` what comes next and hands the attempt to `execute_run`,
exactly as a Celery task would, so both modes record the same rows.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from pipeline.core.states import JobState, StageName, StageState
from pipeline.db.models import Job, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.coordinator import StepKind
from pipeline.orchestration.execution import execute_run
from pipeline.orchestration.progression import advance_job
from pipeline.orchestration.runtime import Runtime

__all__ = ["run_job", "StageEvent", "warm_up"]

log = logging.getLogger(__name__)

_DEFER_S = 1.0
# What a later stage imports when it runs (decompose: torch, about 1 s, and numba). Loaded in a background
# thread while the first stages run, which mostly wait on files and on calibrate's llama.cpp
# child process, so the import no longer lands between stages.
_WARM_MODULES = ("pipeline.stages.decompose.shard", "pipeline.ternary.kernel")
_FINAL = {StepKind.DONE: JobState.SUCCEEDED, StepKind.FAILED: JobState.FAILED,
          StepKind.CANCELLED: JobState.CANCELLED}


@dataclass(frozen=True)
class StageEvent:
    """Reported to the progress callback before and after each stage."""

    job_id: int
    stage: StageName
    state: StageState
    duration_s: float | None = None
    message: str | None = None


def warm_up(ternary_type: str | None = None) -> threading.Thread:
    """Start loading `_WARM_MODULES` in a daemon thread (the exit never waits for it); returns it.

    With `ternary_type`, the thread also loads that type's compiled kernel from numba's cache
    (numba itself and the machine code, ~0.5 s that would otherwise open the decompose stage).
    It never compiles: a kernel not yet cached on this machine is compiled, and announced, by
    the stage itself.
    """

    def load() -> None:
        for name in _WARM_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the stage's own import reports a real failure
                log.debug("warming %s failed; the stage will import it itself", name, exc_info=True)
        if ternary_type is not None:
            _load_kernel(ternary_type)

    thread = threading.Thread(target=load, name="bonsai-warm-imports", daemon=True)
    thread.start()
    return thread


def _load_kernel(ternary_type: str) -> None:
    from pipeline.ternary import kernel_cache

    try:
        kernel_cache.load_cached(ternary_type)
    except Exception:  # noqa: BLE001 - the stage loads the kernel itself and reports a real failure
        log.debug("loading the %s kernel early failed; decompose will load it", ternary_type, exc_info=True)


def _ternary_type(rt: Runtime, job_id: int) -> str | None:
    """The job's ternary type, if its recipe names one (a bad recipe fails in its stage, not here)."""
    from pipeline.ternary.policy import get_recipe

    try:
        with session_scope(rt.sessions) as session:
            job = session.get_one(Job, job_id)
            return get_recipe(job.recipe, dict(job.params or {})).ternary_type
    except Exception:  # noqa: BLE001 - only a head start; the stages report real errors
        return None


def _not_needed(session: Any, job_id: int) -> dict[int, StageName]:
    query = select(StageRun.id, StageRun.stage).where(
        StageRun.job_id == job_id, StageRun.status == StageState.NOT_NEEDED.value)
    return {run_id: StageName(stage) for run_id, stage in session.execute(query)}


def run_job(rt: Runtime, job_id: int, on_event: Callable[[StageEvent], None] | None = None) -> JobState:
    """Run every remaining stage of `job_id` in order; returns the job's final state."""
    notify = on_event or (lambda _event: None)
    warm_up(_ternary_type(rt, job_id))
    with session_scope(rt.sessions) as session:
        told = set(_not_needed(session, job_id))
    while True:
        with session_scope(rt.sessions) as session:
            step = advance_job(session, job_id, max_attempts=rt.max_attempts, retry_base_s=rt.retry_base_s)
            # A stage recorded as not needed while deciding (calibrate of an exact conversion) is news too.
            for run_id, stage in _not_needed(session, job_id).items():
                if run_id not in told:
                    told.add(run_id)
                    notify(StageEvent(job_id, stage, StageState.NOT_NEEDED))
        if step.kind in _FINAL:
            return _FINAL[step.kind]
        assert step.stage is not None and step.run_id is not None
        if step.kind is StepKind.WAIT:
            # Another process holds this attempt; embedded mode does not steal it.
            raise RuntimeError(f"job {job_id}: stage {step.stage.value} is queued or running elsewhere")
        if step.delay_s:
            log.info("job %s stage %s: retrying in %.1fs", job_id, step.stage.value, step.delay_s)
            time.sleep(step.delay_s)
        notify(StageEvent(job_id, step.stage, StageState.RUNNING))
        state = execute_run(rt, step.run_id)
        if state in (StageState.PENDING, StageState.QUEUED):
            time.sleep(_DEFER_S)  # an equal run is in flight in another process: wait for its result
            continue
        with session_scope(rt.sessions) as session:
            run = session.get_one(StageRun, step.run_id)
            notify(StageEvent(job_id, step.stage, state, run.duration_s, run.error_message))
