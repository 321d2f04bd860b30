"""Run one stage attempt: gather inputs, reuse a cached result or call the stage, store, record.

This is the single place where a stage's outcome becomes rows and stored files. The
embedded coordinator and the Celery tasks both call `execute_run`; neither holds any
outcome handling of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from pipeline.artifacts.activity import store_activity
from pipeline.artifacts.store import ArtifactStore
from pipeline.core.errors import InputError, OutgrowsWorker
from pipeline.core.states import LinkDirection, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import Job, StageRun, utcnow
from pipeline.db.session import session_scope
from pipeline.orchestration import fanout, run_ends
from pipeline.orchestration.attempt_log import AttemptLog
from pipeline.orchestration.heartbeat import Heartbeat
from pipeline.orchestration.memory_guard import MemoryGuard
from pipeline.orchestration.plan import plan_for
from pipeline.orchestration.progression import OUT_OF_MEMORY
from pipeline.orchestration.recording import plain, record_failure, record_success, reuse_cached
from pipeline.orchestration.runtime import Runtime
from pipeline.stages import load_stage
from pipeline.stages.base import DigestWitness, InputFile, JobSpec, Stage, StageClients, StageResult

__all__ = ["execute_run", "join_shards", "cache_key", "gather_inputs"]

log = logging.getLogger(__name__)


def cache_key(stage: StageName, version: str, params: Any, inputs: Mapping[str, InputFile]) -> str:
    """hash(stage, stage code version, parameters, input digests): equal keys, equal outputs."""
    payload = {
        "stage": stage.value,
        "version": version,
        "params": plain(params),
        "inputs": {name: item.sha256 for name, item in sorted(inputs.items())},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def gather_inputs(session: Session, store: ArtifactStore, job: Job, stage: StageName) -> dict[str, InputFile]:
    """Outputs of the newest done attempt of each upstream stage, keyed "<stage>/<name>" (a stage
    recorded as not needed gives none)."""
    runs = repo.latest_runs(session, job.id, with_links=True)
    inputs: dict[str, InputFile] = {}
    # The job's own graph: decompose reads calibrate only under recipes that ask for statistics, and
    # validate reads no calibrate that decompose's verdict made unneeded (even one that ran anyway).
    for upstream in plan_for(job.recipe, job.params, runs).reads(stage):
        run = runs.get(upstream)
        if run is None or not run.status.is_done:
            raise InputError(
                f"job {job.id}: stage {stage.value} needs {upstream.value}, whose latest attempt "
                f"is {run.status if run else 'missing'}; retry from {upstream.value}"
            )
        for link in run.links:
            if link.direction != LinkDirection.OUT:
                continue
            artifact = link.artifact
            if artifact.released_at is not None:
                raise InputError(
                    f"job {job.id}: stage {stage.value} reads {upstream.value}'s {link.name}, whose bytes "
                    f"`bonsai gc` removed on {artifact.released_at:%Y-%m-%d %H:%M} UTC; retry from "
                    f"{upstream.value} to make them again")
            inputs[f"{upstream.value}/{link.name}"] = InputFile(
                name=link.name,
                path=store.path(artifact.sha256),
                sha256=artifact.sha256,
                size_bytes=artifact.size_bytes,
            )
    return inputs


@dataclass(frozen=True)
class _FannedOut:
    """The claimed run handed its work to one child run per shard."""

    child_ids: list[int]


@dataclass(frozen=True)
class _Claimed:
    """A run this process now owns, with everything needed to carry it out."""

    module: Stage
    params: Any
    inputs: Mapping[str, InputFile]
    spec: Mapping[str, Any]
    stage: StageName
    job_id: int
    attempt: int


def execute_run(rt: Runtime, run_id: int, use_cache: bool = True) -> StageState:
    """Claim stage run `run_id`, carry it out to a final state and return that state.

    Returns without doing anything when another process holds the run or it is final
    (a duplicate delivery: its current state is returned), or when an equal run is in
    flight elsewhere (the run stays pending/queued: send it again a little later).
    Stage errors are recorded on the row, not raised. What the store did for the attempt
    (cache hits, bytes moved) joins the stage's metrics.
    """
    with store_activity():
        state = _execute_run(rt, run_id, use_cache)
    if state.is_final:
        run_ends.announce()  # an attempt of this process deferred behind this one may go now
    return state


def _execute_run(rt: Runtime, run_id: int, use_cache: bool) -> StageState:
    with AttemptLog() as captured:
        return _carry_out(rt, run_id, use_cache, captured)


def _carry_out(rt: Runtime, run_id: int, use_cache: bool, captured: AttemptLog) -> StageState:
    claimed = _claim(rt, run_id, use_cache, captured)
    if isinstance(claimed, StageState):
        return claimed
    if isinstance(claimed, _FannedOut):
        assert rt.fanout_dispatch is not None
        rt.fanout_dispatch(claimed.child_ids)
        return StageState.RUNNING  # the last child to finish joins the shards (see join_parent)
    module, params, inputs, stage = claimed.module, claimed.params, claimed.inputs, claimed.stage
    job_id, attempt, spec = claimed.job_id, claimed.attempt, claimed.spec
    log.info("job %s stage %s: attempt %s started on %s", job_id, stage.value, attempt, rt.worker_host)

    workdir = rt.work_root / f"job{job_id}-{stage.value}-attempt{attempt}-run{run_id}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    heartbeat = Heartbeat(rt, run_id)
    try:
        _refuse_if_too_big(rt, module, params, inputs, stage)
        with heartbeat, _memory_guard(rt, run_id):
            result = module.run(params, inputs, workdir, _stage_clients(rt))
        with session_scope(rt.sessions) as session:
            _lock_key_of(session, run_id)
            run = _lock_run(session, run_id)
            if run.status != StageState.RUNNING:
                # Cancelled, or declared lost while we worked: our outputs are not wanted.
                log.warning("job %s stage %s: run %s is %s; outputs discarded",
                            job_id, stage.value, run_id, run.status)
                return run.status
            run.log_text = captured.text()
            record_success(rt, session, run, module.VERSION, params, spec, inputs, result)
        return StageState.SUCCEEDED
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded outcome
        log.warning("job %s stage %s: attempt %s failed: %s", job_id, stage.value, attempt, exc)
        with session_scope(rt.sessions) as session:
            run = _lock_run(session, run_id)
            if run.status != StageState.RUNNING:
                return run.status
            run.log_text = captured.text()
            record_failure(session, run, exc)
        return StageState.FAILED
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _claim(
    rt: Runtime, run_id: int, use_cache: bool, captured: AttemptLog
) -> _Claimed | _FannedOut | StageState:
    with session_scope(rt.sessions) as session:
        run = session.get(StageRun, run_id)
        if run is None:
            raise InputError(f"stage run {run_id} does not exist")
        if run.status not in (StageState.PENDING, StageState.QUEUED):
            return run.status
        stage, job = run.stage, run.job
        try:
            module = load_stage(stage, rt.stage_package)
            params = module.make_params(JobSpec(job.source, job.recipe, job.params))
            if run.shard and module.FANOUT is not None:
                params = module.FANOUT.for_shard(params, run.shard)
            inputs = _selected(module, params, gather_inputs(session, rt.store, job, stage))
            key = _cache_key_for(module, stage, params, inputs, rt.clients)
        except SQLAlchemyError:
            raise  # the database itself failed: nothing can be recorded; the reconciler retries
        except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded outcome
            if repo.claim_run(session, run_id, rt.worker_host):
                session.refresh(run)
                run.log_text = captured.text() or None
                record_failure(session, run, exc)
                return StageState.FAILED
            session.refresh(run)
            return run.status
        if key is not None:
            repo.lock_cache_key(session, key)
        if not repo.claim_run(session, run_id, rt.worker_host):
            session.refresh(run)
            return run.status
        session.refresh(run)
        if key is not None and use_cache and not run.is_forced:
            if reuse_cached(session, rt.store, run, key):
                log.info("job %s stage %s: reused outputs of an equal earlier run", job.id, stage.value)
                return StageState.SKIPPED_CACHED
            fresh_after = utcnow() - timedelta(seconds=rt.heartbeat_timeout_s)
            if repo.running_with_key(session, key, run_id, fresh_after):
                # Same work is under way elsewhere (two jobs, one checkpoint): wait for its result.
                session.rollback()
                return session.get_one(StageRun, run_id).status
        run.cache_key = key
        if not run.shard and rt.fanout_dispatch is not None:
            shards = fanout.shards_to_fan_out(module, params, inputs)
            if shards:
                log.info("job %s stage %s: fanning out over %d shards", job.id, stage.value, len(shards))
                return _FannedOut(fanout.spawn_children(session, run, list(shards)))
        return _Claimed(module, params, inputs, _spec(job), stage, job.id, run.attempt)


def _selected(module: Stage, params: Any, inputs: dict[str, InputFile]) -> Mapping[str, InputFile]:
    """The upstream outputs the stage reads for these params."""
    return dict(module.select_inputs(params, inputs))


def _spec(job: Job) -> dict[str, Any]:
    return {"source": job.source, "recipe": job.recipe, "options": job.params}


def join_shards(rt: Runtime, parent_id: int) -> fanout.JoinOutcome:
    """After a shard child finished: retry it, fail the parent, or merge the shards into it."""

    def record(
        session: Session, parent: StageRun, inputs: Mapping[str, InputFile], result: StageResult
    ) -> None:
        module = load_stage(parent.stage, rt.stage_package)
        job = parent.job
        params = module.make_params(JobSpec(job.source, job.recipe, job.params))
        record_success(rt, session, parent, module.VERSION, params, _spec(job), inputs, result)

    try:
        with store_activity(), session_scope(rt.sessions) as session:
            _lock_key_of(session, parent_id)
            return fanout.settle_parent(session, rt.store, parent_id, rt.max_attempts, record)
    except SQLAlchemyError:
        raise
    except Exception as exc:  # noqa: BLE001 - a merge that cannot succeed fails the parent, recorded
        log.warning("run %s: joining its shards failed: %s", parent_id, exc)
        with session_scope(rt.sessions) as session:
            parent = _lock_run(session, parent_id)
            if parent.status == StageState.RUNNING:
                record_failure(session, parent, exc)
        return fanout.JoinOutcome(parent_state=StageState.FAILED)


def _refuse_if_too_big(
    rt: Runtime, module: Stage, params: Any, inputs: Mapping[str, InputFile], stage: StageName
) -> None:
    """Refuse, before it starts, a run that this worker's memory cap cannot hold."""
    cap_bytes = rt.memory_limit_bytes
    if not cap_bytes:
        return
    need = module.memory_need(params, inputs)
    if need is not None and need.n_bytes > cap_bytes:
        raise OutgrowsWorker(
            f"{stage.value} would need about {need.n_bytes >> 20:,} MB ({need.why}), over this worker's "
            f"cap of {cap_bytes >> 20:,} MB (BONSAI_WORKER_MEMORY_MB); run it on a worker with more memory "
            "(README: Memory and disk)", need.n_bytes, cap_bytes)


def _memory_guard(rt: Runtime, run_id: int) -> contextlib.AbstractContextManager[object]:
    """Outside a worker (no cap): nothing. In a worker: stop the attempt past its memory cap."""
    cap_bytes = rt.memory_limit_bytes
    if not cap_bytes:
        return contextlib.nullcontext()

    def exceeded(used_bytes: int) -> None:
        with session_scope(rt.sessions) as session:
            run = _lock_run(session, run_id)
            if run.status == StageState.RUNNING:
                repo.set_stage_state(
                    session, run, StageState.FAILED, error_kind="retryable",
                    error_message=f"{OUT_OF_MEMORY}: the stage's process grew to {used_bytes >> 20:,} MB, "
                    f"over this worker's cap of {cap_bytes >> 20:,} MB (BONSAI_WORKER_MEMORY_MB); "
                    "run it on a worker with more memory or raise the cap",
                )
        # Give the memory back now; the worker's main process sees its child gone and moves on.
        os.kill(os.getpid(), signal.SIGKILL)

    return MemoryGuard(cap_bytes, exceeded)


def _cache_key_for(module: Stage, stage: StageName, params: Any, inputs: Mapping[str, InputFile],
                   clients: StageClients) -> str | None:
    identity = module.cache_identity(params, clients)
    if identity is None:
        return None  # the stage says its result cannot be reused (say, a folder that may change)
    return cache_key(stage, module.VERSION, {"params": params, "identity": identity}, inputs)


def _lock_key_of(session: Session, run_id: int) -> None:
    """Hold the run's cache-key lock while its outcome is written.

    An equal-key claim checks "done?" then "running?" under this lock; without it a success
    committed between the two checks would look like neither, and the same work ran twice.
    """
    key = session.scalar(select(StageRun.cache_key).where(StageRun.id == run_id))
    if key is not None:
        repo.lock_cache_key(session, key)


def _lock_run(session: Session, run_id: int) -> StageRun:
    # FOR UPDATE (ignored by SQLite): a concurrent cancel or reconcile waits for our verdict.
    return session.execute(
        select(StageRun).where(StageRun.id == run_id).with_for_update()
    ).scalar_one()


def _stage_clients(rt: Runtime) -> StageClients:
    # A store that vouches for the files it wrote spares the checksum stage a second read of them.
    if rt.clients.store_witness is None and isinstance(rt.store, DigestWitness):
        return replace(rt.clients, store_witness=rt.store)
    return rt.clients
