"""Database side of submit, retry and cancel; the broker side lives in orchestration.distributed."""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.orm import Session

from pipeline.core.errors import InputError
from pipeline.core.states import STAGE_ORDER, JobState, StageName, StageState
from pipeline.db import repo
from pipeline.orchestration import coordinator
from pipeline.provenance.statements import redact
from pipeline.stages.sources import SourcePolicy

__all__ = ["JobRequest", "read_manifest", "check_request", "create_jobs", "retry_job", "cancel_job"]

_MANIFEST_KEYS = {"source", "recipe", "priority", "options"}


class _ShortRepr(reprlib.Repr):
    """Bounded repr for messages: YAML aliases can make a small file a huge (shared) structure,
    and an integer past Python's 4300-digit limit has no repr at all."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxstring, self.maxother = 3, 4, 4, 80, 80

    def repr_int(self, x: int, level: int) -> str:
        return f"<integer of {x.bit_length()} bits>" if x.bit_length() > 256 else repr(x)


_SHORT = _ShortRepr()


@dataclass(frozen=True)
class JobRequest:
    source: str
    recipe: str = "tq2_0"
    priority: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


def read_manifest(path: Path, default_recipe: str, default_priority: int) -> list[JobRequest]:
    """Jobs from a YAML or JSON manifest: a list of sources, or of {source, recipe, priority, options}.

    The list may also sit under a top-level `jobs:` key. Errors name the entry at fault.
    """
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"manifest {path} cannot be read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"manifest {path} is not UTF-8 text (byte {exc.start})") from exc
    try:
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:  # JSONDecodeError, and ints over Python's digit limit
        raise InputError(f"manifest {path} is not valid {kind}: {exc}") from exc
    except RecursionError as exc:
        raise InputError(f"manifest {path}: nested too deeply to be a list of jobs") from exc
    if isinstance(data, dict):
        data = data.get("jobs")
    if not isinstance(data, list) or not data:
        raise InputError(f"manifest {path}: expected a non-empty list of jobs (or a `jobs:` list)")
    return [_manifest_entry(path, index, item, default_recipe, default_priority)
            for index, item in enumerate(data, 1)]


def _manifest_entry(path: Path, index: int, item: Any, recipe: str, priority: int) -> JobRequest:
    if isinstance(item, str):
        item = {"source": item}
    if not isinstance(item, dict) or not isinstance(item.get("source"), str) or not item["source"].strip():
        raise InputError(f"manifest {path}, entry {index}: needs a `source` string, got {_SHORT.repr(item)}")
    unknown = set(item) - _MANIFEST_KEYS
    if unknown:
        shown = sorted(key[:80] if isinstance(key, str) else _SHORT.repr(key) for key in unknown)[:8]
        raise InputError(f"manifest {path}, entry {index}: unknown keys {shown}; "
                         f"allowed: {sorted(_MANIFEST_KEYS)}")
    if not isinstance(item.get("recipe", recipe), str):
        raise InputError(f"manifest {path}, entry {index}: recipe must be a string")
    given = item.get("priority", priority)
    if not isinstance(given, int) or isinstance(given, bool):
        raise InputError(f"manifest {path}, entry {index}: priority must be an integer")
    if not isinstance(item.get("options", {}), dict):
        raise InputError(f"manifest {path}, entry {index}: options must be a mapping")
    _check_options(item.get("options", {}), f"manifest {path}, entry {index}")
    return JobRequest(item["source"].strip(), item.get("recipe", recipe), item.get("priority", priority),
                      item.get("options", {}))


_MAX_OPTION_NODES = 10_000
_OPTION_SCALARS = (str, int, float, bool, type(None))


def _check_options(options: Mapping[str, Any], where: str) -> None:
    """Options are stored as JSON: string keys, JSON values, and small (YAML aliases can make a
    few lines a structure of billions of nodes). InputError naming the first problem."""
    pending: list[Any] = [options]
    seen = 0
    while pending:
        value = pending.pop()
        seen += 1
        if seen > _MAX_OPTION_NODES:
            raise InputError(f"{where}: options hold over {_MAX_OPTION_NODES} values; keep them small")
        if isinstance(value, dict):
            bad = next((k for k in value if not isinstance(k, str)), None)
            if bad is not None:
                raise InputError(f"{where}: option key {_SHORT.repr(bad)} is not a string")
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif not isinstance(value, _OPTION_SCALARS):
            raise InputError(f"{where}: option value {_SHORT.repr(value)} is a {type(value).__name__}, "
                             "not a JSON value")


def check_request(request: JobRequest) -> None:
    """Refuse options that look like secrets: job options are stored and shown to every reader."""
    if redact(request.options) != dict(request.options):
        raise InputError(
            f"job for {request.source}: options must not carry secrets (token, password…); "
            "the Hugging Face token belongs in BONSAI_HF_TOKEN on the workers"
        )


def create_jobs(
    session: Session, requests: Sequence[JobRequest], submitted_by: str | None, policy: SourcePolicy
) -> list[int]:
    """Record the jobs (checked first, so a bad one records none of them); returns their ids.

    `policy` says which local paths this submitter may name (the API: only under
    BONSAI_SOURCE_ROOTS); InputError names the first request it refuses.
    """
    for request in requests:
        check_request(request)
    for request in requests:
        policy.check(request.source)
    return [
        repo.create_job(session, r.source, r.recipe, r.options, r.priority, submitted_by).id for r in requests
    ]


def retry_job(session: Session, job_id: int, from_stage: StageName | None, force: bool) -> list[int]:
    """New pending attempts for `from_stage` and every stage after it; earlier attempts stay.

    Returns the new run ids. Refuses while the job has an attempt queued or running.
    """
    job = repo.get_job(session, job_id)
    latest = repo.latest_runs(session, job_id)
    active = [s.value for s, run in latest.items() if run.status in (StageState.QUEUED.value,
                                                                       StageState.RUNNING.value)]
    if active:
        raise InputError(f"job {job_id} has {', '.join(active)} queued or running; cancel it or wait")
    states = {stage: StageState(run.status) for stage, run in latest.items()}
    stages = coordinator.retry_stages(states, from_stage)
    if not stages:
        raise InputError(f"job {job_id} has nothing to retry: every stage succeeded (use --from STAGE)")
    first = stages[0]
    upstream_missing = [s.value for s in STAGE_ORDER[: STAGE_ORDER.index(first)]
                        if states.get(s) not in (StageState.SUCCEEDED, StageState.SKIPPED_CACHED)]
    if upstream_missing:
        raise InputError(f"job {job_id}: cannot retry from {first.value} before "
                         f"{', '.join(upstream_missing)} succeeded; retry from {upstream_missing[0]}")
    run_ids = []
    for stage in stages:
        run = repo.new_attempt(session, job, stage)
        run.is_forced = force
        run_ids.append(run.id)
    if JobState(job.status) is not JobState.RUNNING:
        repo.set_job_state(session, job, JobState.RUNNING)
    return run_ids


def cancel_job(session: Session, job_id: int) -> list[str]:
    """Cancel the job and its unfinished attempts; returns task ids of attempts to revoke."""
    job = repo.get_job(session, job_id)
    if JobState(job.status).is_final:
        raise InputError(f"job {job_id} is already {job.status}; nothing to cancel")
    revoke = []
    for run in job.stage_runs:
        if not StageState(run.status).is_final:
            if run.task_id:
                revoke.append(run.task_id)
            repo.set_stage_state(session, run, StageState.CANCELLED)
    repo.set_job_state(session, job, JobState.CANCELLED, error_message="cancelled by user")
    return revoke
