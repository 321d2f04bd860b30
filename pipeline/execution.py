"""Run one stage attempt: gather inputs, reuse a cached result or call the stage, store, record.

This is the single place where a stage's outcome becomes rows and stored files. The
embedded coordinator and the Celery tasks both call `execute_run`; neither holds any
outcome handling of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import socket
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from pipeline import fanout, provenance, signing
from pipeline.artifacts.store import ArtifactStore, put_all
from pipeline.db import repo
from pipeline.db.models import Job, StageRun, utcnow
from pipeline.db.session import session_scope
from pipeline.errors import InputError, error_kind
from pipeline.stages import UPSTREAM, load_stage
from pipeline.stages.base import InputFile, JobSpec, StageResult
from pipeline.states import StageName, StageState

__all__ = ["Runtime", "execute_run", "join_parent", "cache_key", "gather_inputs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """What a process that runs stages holds: the database, the store, scratch space, clients."""

    sessions: sessionmaker[Session]
    store: ArtifactStore
    work_root: Path
    # host:pid, so an operator (or a test) can tell which process ran an attempt.
    worker_host: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # Outside-world clients (the hub) passed to the stages whose run() accepts them.
    clients: Mapping[str, Any] = field(default_factory=dict)
    # Seconds between heartbeats of a running stage; the reconciler's timeout is larger.
    heartbeat_s: float = 10.0
    # Attempts of one stage before its job fails, and the first retry delay (doubling).
    max_attempts: int = 3
    retry_base_s: float = 5.0
    stage_package: str = "pipeline.stages"
    # Ed25519 private key: when set, every statement is signed (DSSE) as it is recorded.
    signing_key: Any | None = None
    # Distributed mode: sends shard child runs to workers; None decomposes shards in-process.
    fanout_dispatch: Callable[[list[int]], None] | None = None


def cache_key(stage: StageName, version: str, params: Any, inputs: Mapping[str, InputFile]) -> str:
    """hash(stage, stage code version, parameters, input digests): equal keys, equal outputs."""
    payload = {
        "stage": stage.value,
        "version": version,
        "params": _plain(params),
        "inputs": {name: item.sha256 for name, item in sorted(inputs.items())},
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def gather_inputs(session: Session, store: ArtifactStore, job: Job, stage: StageName) -> dict[str, InputFile]:
    """Outputs of the newest successful attempt of each upstream stage, keyed "<stage>/<name>"."""
    runs = repo.latest_runs(session, job.id, with_links=True)
    inputs: dict[str, InputFile] = {}
    for upstream in UPSTREAM[stage]:
        run = runs.get(upstream)
        if run is None or run.status not in (StageState.SUCCEEDED.value, StageState.SKIPPED_CACHED.value):
            raise InputError(
                f"job {job.id}: stage {stage.value} needs {upstream.value}, whose latest attempt "
                f"is {run.status if run else 'missing'}; retry from {upstream.value}"
            )
        for link in run.links:
            if link.direction != "out":
                continue
            artifact = link.artifact
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

    module: Any
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
    Stage errors are recorded on the row, not raised.
    """
    claimed = _claim(rt, run_id, use_cache)
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
    heartbeat = _Heartbeat(rt, run_id)
    try:
        with heartbeat:
            result = module.run(params, inputs, workdir, **_clients_for(module.run, _stage_clients(rt)))
        with session_scope(rt.sessions) as session:
            run = _lock_run(session, run_id)
            if run.status != StageState.RUNNING.value:
                # Cancelled, or declared lost while we worked: our outputs are not wanted.
                log.warning("job %s stage %s: run %s is %s; outputs discarded",
                            job_id, stage.value, run_id, run.status)
                return StageState(run.status)
            _record_success(rt, session, run, module.VERSION, params, spec, inputs, result)
        return StageState.SUCCEEDED
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded outcome
        log.warning("job %s stage %s: attempt %s failed: %s", job_id, stage.value, attempt, exc)
        with session_scope(rt.sessions) as session:
            run = _lock_run(session, run_id)
            if run.status != StageState.RUNNING.value:
                return StageState(run.status)
            _record_failure(session, run, exc)
        return StageState.FAILED
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _claim(rt: Runtime, run_id: int, use_cache: bool) -> _Claimed | _FannedOut | StageState:
    with session_scope(rt.sessions) as session:
        run = session.get(StageRun, run_id)
        if run is None:
            raise InputError(f"stage run {run_id} does not exist")
        if run.status not in (StageState.PENDING.value, StageState.QUEUED.value):
            return StageState(run.status)
        stage, job = StageName(run.stage), run.job
        try:
            module = load_stage(stage, rt.stage_package)
            params = module.make_params(JobSpec(job.source, job.recipe, job.params))
            if run.shard:
                params = dataclasses.replace(params, shards=(run.shard,))
            inputs = gather_inputs(session, rt.store, job, stage)
            key = _cache_key_for(module, stage, params, inputs, rt.clients)
        except SQLAlchemyError:
            raise  # the database itself failed: nothing can be recorded; the reconciler retries
        except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded outcome
            if repo.claim_run(session, run_id, rt.worker_host):
                session.refresh(run)
                _record_failure(session, run, exc)
                return StageState.FAILED
            session.refresh(run)
            return StageState(run.status)
        if key is not None:
            repo.lock_cache_key(session, key)
        if not repo.claim_run(session, run_id, rt.worker_host):
            session.refresh(run)
            return StageState(run.status)
        session.refresh(run)
        if key is not None and use_cache and not run.is_forced:
            if _reuse_cached(session, rt.store, run, key):
                log.info("job %s stage %s: reused outputs of an equal earlier run", job.id, stage.value)
                return StageState.SKIPPED_CACHED
            fresh_after = utcnow() - timedelta(seconds=rt.heartbeat_s * 3)
            if repo.running_with_key(session, key, run_id, fresh_after):
                # Same work is under way elsewhere (two jobs, one checkpoint): wait for its result.
                session.rollback()
                return StageState(session.get_one(StageRun, run_id).status)
        run.cache_key = key
        if not run.shard and rt.fanout_dispatch is not None:
            shards = fanout.shards_to_fan_out(stage, inputs)
            if shards:
                log.info("job %s stage %s: fanning out over %d shards", job.id, stage.value, len(shards))
                return _FannedOut(fanout.spawn_children(session, run, shards))
        return _Claimed(module, params, inputs, _spec(job), stage, job.id, run.attempt)


def _spec(job: Job) -> dict[str, Any]:
    return {"source": job.source, "recipe": job.recipe, "options": job.params}


def join_parent(rt: Runtime, parent_id: int) -> fanout.JoinOutcome:
    """After a shard child finished: retry it, fail the parent, or merge the shards into it."""

    def record(
        session: Session, parent: StageRun, inputs: Mapping[str, InputFile], result: StageResult
    ) -> None:
        module = load_stage(StageName(parent.stage), rt.stage_package)
        job = parent.job
        params = module.make_params(JobSpec(job.source, job.recipe, job.params))
        _record_success(rt, session, parent, module.VERSION, params, _spec(job), inputs, result)

    try:
        with session_scope(rt.sessions) as session:
            return fanout.join(session, rt.store, parent_id, rt.max_attempts, record)
    except SQLAlchemyError:
        raise
    except Exception as exc:  # noqa: BLE001 - a merge that cannot succeed fails the parent, recorded
        log.warning("run %s: joining its shards failed: %s", parent_id, exc)
        with session_scope(rt.sessions) as session:
            parent = _lock_run(session, parent_id)
            if parent.status == StageState.RUNNING.value:
                _record_failure(session, parent, exc)
        return fanout.JoinOutcome(parent_state=StageState.FAILED)


def _cache_key_for(module: Any, stage: StageName, params: Any, inputs: Mapping[str, InputFile],
                   clients: Mapping[str, Any]) -> str | None:
    identity_of = getattr(module, "cache_identity", None)
    identity = identity_of(params, **_clients_for(identity_of, clients)) if identity_of else ""
    if identity is None:
        return None  # the stage says its result cannot be reused (say, a folder that may change)
    return cache_key(stage, module.VERSION, {"params": params, "identity": identity}, inputs)


def _lock_run(session: Session, run_id: int) -> StageRun:
    # FOR UPDATE (ignored by SQLite): a concurrent cancel or reconcile waits for our verdict.
    return session.execute(
        select(StageRun).where(StageRun.id == run_id).with_for_update()
    ).scalar_one()


class _Heartbeat:
    """Stamps the run as alive every `rt.heartbeat_s` seconds while the stage works."""

    def __init__(self, rt: Runtime, run_id: int) -> None:
        self._rt, self._run_id = rt, run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{run_id}", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._rt.heartbeat_s):
            try:
                with session_scope(self._rt.sessions) as session:
                    repo.touch_heartbeat(session, self._run_id)
            except Exception:  # noqa: BLE001 - a missed beat (database restarting) is not fatal
                log.warning("run %s: heartbeat not recorded", self._run_id, exc_info=True)


def _clients_for(func: Any, clients: Mapping[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(clients)
    return {name: client for name, client in clients.items() if name in accepted}


def _stage_clients(rt: Runtime) -> dict[str, Any]:
    # A store that vouches for the files it wrote spares the checksum stage a second read of them.
    witness = {"store_witness": rt.store} if hasattr(rt.store, "witnessed") else {}
    return {**witness, **rt.clients}


def _reuse_cached(session: Session, store: ArtifactStore, run: StageRun, key: str) -> bool:
    source = repo.find_cached_run(session, key, exclude_run_id=run.id)
    if source is None:
        return False
    outputs = [link for link in source.links if link.direction == "out"]
    if not all(store.has(link.artifact_sha256) for link in outputs):
        return False  # the store lost bytes: recompute rather than hand out a hole
    for link in outputs:
        repo.link_artifact(session, run, "out", link.name, link.artifact)
    _note_revision(run, source.metrics)
    repo.set_stage_state(
        session,
        run,
        StageState.SKIPPED_CACHED,
        cache_key=key,
        cached_from_id=source.id,
        metrics=dict(source.metrics),
        device=source.device,
    )
    return True


def _record_success(
    rt: Runtime,
    session: Session,
    run: StageRun,
    stage_version: str,
    params: Any,
    spec: Mapping[str, Any],
    inputs: Mapping[str, InputFile],
    result: StageResult,
) -> None:
    finished_at = utcnow()
    device = str(result.metrics.get("device", "cpu"))
    facts = provenance.BuildFacts(
        stage=run.stage,
        stage_version=stage_version,
        stage_run_id=run.id,
        job_id=run.job_id,
        attempt=run.attempt,
        worker_host=rt.worker_host,
        device=device,
        started_at=run.started_at or finished_at,
        finished_at=finished_at,
        cache_key=run.cache_key,
    )
    input_refs = [(name, item.sha256, rt.store.uri(item.sha256)) for name, item in inputs.items()]
    external = {
        **spec,
        "resolved_revision": run.job.resolved_revision,
        "stage_parameters": _plain(params),
    }
    known = repo.artifacts_by_digest(session, {item.sha256 for item in inputs.values()})
    for name, item in inputs.items():
        stored = known.get(item.sha256) or repo.record_artifact(
            session, item.sha256, item.size_bytes, rt.store.uri(item.sha256), "input",
            "application/octet-stream", None,
        )
        repo.link_artifact(session, run, "in", name, stored)
    stored_files = put_all(rt.store, [(output.path, output.sha256) for output in result.outputs])
    for output, stored_file in zip(result.outputs, stored_files, strict=True):
        artifact = repo.record_artifact(
            session, stored_file.sha256, stored_file.size_bytes, stored_file.uri,
            output.kind, output.media_type, run,
        )
        repo.link_artifact(session, run, "out", output.name, artifact)
        statement = provenance.build_statement(output.name, artifact.sha256, external, input_refs, facts)
        repo.add_provenance(session, artifact, run, statement)
        if rt.signing_key is not None:
            signing.store_envelope(session, rt.store, run, signing.sign_statement(statement, rt.signing_key))
    _note_revision(run, result.metrics)
    repo.set_stage_state(
        session, run, StageState.SUCCEEDED,
        metrics=_jsonable(result.metrics), warnings=list(result.warnings), device=device,
    )


def _note_revision(run: StageRun, metrics: Mapping[str, Any]) -> None:
    if run.stage == StageName.DOWNLOAD.value and metrics.get("resolved_revision"):
        run.job.resolved_revision = str(metrics["resolved_revision"])


def _error_kind(exc: BaseException) -> str:
    # A dropped database connection says nothing about the stage: another attempt may succeed.
    if isinstance(exc, OperationalError | InterfaceError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    ):
        return "retryable"
    return error_kind(exc)


def _record_failure(session: Session, run: StageRun, exc: BaseException) -> None:
    # A stage may attach the evidence of its failure (validate's whole report) as metrics.
    evidence = getattr(exc, "metrics", None)
    extra = {"metrics": _jsonable(evidence)} if isinstance(evidence, Mapping) else {}
    repo.set_stage_state(
        session,
        run,
        StageState.FAILED,
        error_kind=_error_kind(exc),
        error_message=f"{type(exc).__name__}: {exc}",
        error_traceback="".join(traceback.format_exception(exc))[-20000:],
        **extra,
    )


def _jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    plain: dict[str, Any] = json.loads(json.dumps(dict(metrics), default=str))
    return plain
