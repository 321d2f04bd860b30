"""Embedded mode: run a job's stages in this process, each as soon as its inputs are done.

The loop asks `advance_job` which stages are ready and hands each attempt to `execute_run` on a
small thread pool, exactly as a Celery task would, so both modes record the same rows. Stages
that run side by side mostly wait on files and child processes (calibrate's llama.cpp run) or
in numba kernels, which release the GIL. Only this loop's thread advances the job.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from pipeline.core.states import JobState, StageName, StageState
from pipeline.db.models import Job, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration import run_ends
from pipeline.orchestration.execution import execute_run
from pipeline.orchestration.progression import Advance, advance_job
from pipeline.orchestration.runtime import Runtime
from pipeline.orchestration.store_gc import release_source

__all__ = ["run_job", "StageEvent", "warm_up"]

log = logging.getLogger(__name__)

# A deferred attempt starts again when a run of this process ends (`run_ends`); at the latest after
# this long, for an equal run in another process, which cannot signal here.
_FOREIGN_RECHECK_S = 1.0
# What a later stage imports when it runs (decompose: torch, about 1 s, and numba). Loaded in a background
# thread while the first stages run, which mostly wait on files and on calibrate's llama.cpp
# child process, so the import no longer lands between stages.
_WARM_MODULES = ("pipeline.stages.conversion.shard", "pipeline.ternary.kernel")


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
        StageRun.job_id == job_id, StageRun.status == StageState.NOT_NEEDED)
    return {run_id: stage for run_id, stage in session.execute(query)}


def run_job(rt: Runtime, job_id: int, on_event: Callable[[StageEvent], None] | None = None) -> JobState:
    """Run every remaining stage of `job_id`, each as soon as its inputs are done (up to
    ``rt.stage_threads`` at once); returns the job's final state."""
    warm_up(_ternary_type(rt, job_id))
    with ThreadPoolExecutor(max_workers=rt.stage_threads, thread_name_prefix=f"bonsai-job{job_id}") as pool:
        state = _JobRun(rt, job_id, on_event or (lambda _event: None), pool).run()
    if state is JobState.SUCCEEDED:
        release_source(rt.sessions, rt.store, job_id)
    return state


class _JobRun:
    """One job's loop: only this thread advances the job; stage attempts run on the pool."""

    def __init__(self, rt: Runtime, job_id: int, notify: Callable[[StageEvent], None],
                 pool: ThreadPoolExecutor) -> None:
        self.rt, self.job_id, self.notify, self.pool = rt, job_id, notify, pool
        self.running: dict[int, Future[tuple[StageState, int]]] = {}
        # Attempts that found an equal run in flight, with `run_ends.mark` from just before they looked.
        self.deferred: dict[int, int] = {}
        with session_scope(rt.sessions) as session:
            self.told = set(_not_needed(session, job_id))

    def run(self) -> JobState:
        while True:
            outcome = self._advance()
            if outcome.final is not None and not self.running:
                return outcome.final
            if outcome.final is None:
                self._start(outcome)
            if not self.running:
                raise RuntimeError(f"job {self.job_id}: no stage can run and none is running")
            finished, _ = wait(self.running.values(), return_when=FIRST_COMPLETED)
            for run_id, future in list(self.running.items()):
                if future in finished:
                    del self.running[run_id]
                    self._report(run_id, *future.result())

    def _advance(self) -> Advance:
        with session_scope(self.rt.sessions) as session:
            outcome = advance_job(session, self.job_id, max_attempts=self.rt.max_attempts,
                                  retry_base_s=self.rt.retry_base_s)
            # A stage recorded as not needed while deciding (calibrate of an exact conversion) is news too.
            for run_id, stage in _not_needed(session, self.job_id).items():
                if run_id not in self.told:
                    self.told.add(run_id)
                    self.notify(StageEvent(self.job_id, stage, StageState.NOT_NEEDED))
        return outcome

    def _start(self, outcome: Advance) -> None:
        foreign = [step for step in outcome.in_flight if step.run_id not in self.running]
        if foreign:
            # Another process holds this attempt; embedded mode does not steal it.
            stage = foreign[0].stage.value
            raise RuntimeError(f"job {self.job_id}: stage {stage} is queued or running elsewhere")
        for step in outcome.ready:
            if step.run_id in self.running:
                continue  # submitted, not yet claimed by its thread
            if len(self.running) >= self.rt.stage_threads:
                break  # stays pending: the next look at the job starts it
            behind = self.deferred.pop(step.run_id, None)
            if step.delay_s:
                log.info("job %s stage %s: starting in %.1fs", self.job_id, step.stage.value, step.delay_s)
            elif behind is not None:
                log.info("job %s stage %s: waiting for the equal run in flight to end", self.job_id,
                         step.stage.value)
            self.notify(StageEvent(self.job_id, step.stage, StageState.RUNNING))
            self.running[step.run_id] = self.pool.submit(_execute_after, self.rt, step.run_id, step.delay_s,
                                                         behind)

    def _report(self, run_id: int, state: StageState, seen: int) -> None:
        if state in (StageState.PENDING, StageState.QUEUED):
            self.deferred[run_id] = seen  # an equal run is in flight: start again when it ends
            return
        with session_scope(self.rt.sessions) as session:
            run = session.get_one(StageRun, run_id)
            event = StageEvent(self.job_id, run.stage, state, run.duration_s, run.error_message)
        self.notify(event)


def _execute_after(rt: Runtime, run_id: int, delay_s: float, behind: int | None) -> tuple[StageState, int]:
    """The attempt's state after a retry's backoff (``delay_s``), or once a run has ended since
    ``behind`` (the mark it was deferred at); with the mark taken before this look, for the next."""
    if delay_s:
        time.sleep(delay_s)
    elif behind is not None:
        run_ends.wait_after(behind, _FOREIGN_RECHECK_S)
    seen = run_ends.mark()
    return execute_run(rt, run_id), seen
