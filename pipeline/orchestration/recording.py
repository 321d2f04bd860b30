"""How a stage attempt's outcome becomes rows: outputs stored and linked, provenance, or the failure.

Called by `execution` only, with the run row locked by the caller's transaction.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import traceback
from collections.abc import Mapping
from typing import Any

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from pipeline.artifacts.activity import current_activity
from pipeline.artifacts.store import ArtifactStore, put_all
from pipeline.core.errors import error_kind
from pipeline.core.states import LinkDirection, StageState
from pipeline.db import repo, retention
from pipeline.db.models import StageRun, utcnow
from pipeline.orchestration.runtime import Runtime
from pipeline.provenance import signing
from pipeline.provenance import statements as provenance
from pipeline.stages.base import SOURCE_REVISION_METRIC, InputFile, StageResult

__all__ = ["plain", "reuse_cached", "record_success", "record_failure", "jsonable"]


def plain(value: Any) -> Any:
    """Dataclasses and mappings as plain dicts (for cache keys and provenance parameters)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    return value


def reuse_cached(session: Session, store: ArtifactStore, run: StageRun, key: str) -> bool:
    source = repo.find_cached_run(session, key, exclude_run_id=run.id)
    if source is None:
        return False
    outputs = [link for link in source.links if link.direction == LinkDirection.OUT]
    retention.hold_store_shared(session)  # gc must not take the bytes between this check and the commit
    if not all(store.has(link.artifact_sha256) for link in outputs):
        return False  # the store lost bytes: recompute rather than hand out a hole
    for link in outputs:
        repo.link_artifact(session, run, LinkDirection.OUT, link.name, link.artifact)
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




def record_success(
    rt: Runtime,
    session: Session,
    run: StageRun,
    stage_version: str,
    params: Any,
    spec: Mapping[str, Any],
    inputs: Mapping[str, InputFile],
    result: StageResult,
) -> None:
    # From storing the outputs (maybe finding equal bytes stored already) to linking them: no gc.
    retention.hold_store_shared(session)
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
        worker_name=rt.worker_name,
        started_at=run.started_at or finished_at,
        finished_at=finished_at,
        cache_key=run.cache_key,
    )
    input_refs = [(name, item.sha256, rt.store.uri(item.sha256)) for name, item in inputs.items()]
    external = {
        **spec,
        "resolved_revision": run.job.resolved_revision,
        "stage_parameters": plain(params),
    }
    known = repo.artifacts_by_digest(session, {item.sha256 for item in inputs.values()})
    for name, item in inputs.items():
        stored = known.get(item.sha256) or repo.record_artifact(
            session, item.sha256, item.size_bytes, rt.store.uri(item.sha256), "input",
            "application/octet-stream", None,
        )
        repo.link_artifact(session, run, LinkDirection.IN, name, stored)
    stored_files = put_all(rt.store, [(output.path, output.sha256) for output in result.outputs])
    for output, stored_file in zip(result.outputs, stored_files, strict=True):
        artifact = repo.record_artifact(
            session, stored_file.sha256, stored_file.size_bytes, stored_file.uri,
            output.kind, output.media_type, run,
        )
        repo.link_artifact(session, run, LinkDirection.OUT, output.name, artifact)
        statement = provenance.build_statement(output.name, artifact.sha256, external, input_refs, facts)
        repo.add_provenance(session, artifact, run, statement)
        if rt.signing_key is not None:
            signing.store_envelope(session, rt.store, run, signing.sign_statement(statement, rt.signing_key))
    _note_revision(run, result.metrics)
    activity = current_activity()
    store_metrics = activity.as_metrics() if activity is not None else {}
    repo.set_stage_state(
        session, run, StageState.SUCCEEDED,
        metrics=jsonable({**result.metrics, **store_metrics}), warnings=list(result.warnings), device=device,
    )




def _note_revision(run: StageRun, metrics: Mapping[str, Any]) -> None:
    if metrics.get(SOURCE_REVISION_METRIC):
        run.job.resolved_revision = str(metrics[SOURCE_REVISION_METRIC])




def _error_kind(exc: BaseException) -> str:
    # A dropped database connection says nothing about the stage: another attempt may succeed.
    if isinstance(exc, OperationalError | InterfaceError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    ):
        return "retryable"
    return error_kind(exc)




def record_failure(session: Session, run: StageRun, exc: BaseException) -> None:
    # A stage may attach the evidence of its failure (validate's whole report) as metrics.
    evidence = getattr(exc, "metrics", None)
    extra = {"metrics": jsonable(evidence)} if isinstance(evidence, Mapping) else {}
    kind, message = _error_kind(exc), f"{type(exc).__name__}: {exc}"
    # A stage does not know its job: its "see `bonsai show JOB`" gets the real number here.
    message = message.replace("bonsai show JOB", f"bonsai show {run.job_id}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        # Not the stage's fault and maybe passing (space freed): retryable, with the fix named.
        kind = "retryable"
        message = (f"disk full: no space left writing {exc.filename or 'a file'}; free space on that disk "
                   "or point BONSAI_WORK_ROOT / BONSAI_ARTIFACT_ROOT at a larger one, then retry")
    repo.set_stage_state(
        session,
        run,
        StageState.FAILED,
        error_kind=kind,
        error_message=message,
        error_traceback="".join(traceback.format_exception(exc))[-20000:],
        **extra,
    )




def jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    plain: dict[str, Any] = json.loads(json.dumps(dict(metrics), default=str))
    return plain
