"""Database side of submit, retry and cancel; the broker side lives in orchestration.distributed."""

from __future__ import annotations

import difflib
import json
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.orm import Session

from pipeline.core.errors import InputError
from pipeline.core.states import (
    DONE_STATES,
    STAGE_ORDER,
    JobState,
    LinkDirection,
    StageName,
    StageState,
    downstream_of,
    upstream_of,
)
from pipeline.core.teams import NO_TEAMS, Teams, team_of
from pipeline.db import actions, repo
from pipeline.db.models import StageRun
from pipeline.orchestration import coordinator, team_caps
from pipeline.orchestration.plan import JobPlan, plan_for
from pipeline.provenance.statements import redact
from pipeline.stages import load_stage
from pipeline.stages.base import JobSpec
from pipeline.stages.options import check_job_input
from pipeline.stages.sources import SourcePolicy, escaped

__all__ = ["JobRequest", "read_manifest", "check_request", "create_jobs", "retry_job", "cancel_job"]

_MANIFEST_KEYS = {"source", "recipe", "priority", "options", "target"}


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
    """What a submitter asked for. ``recipe`` None: the ``target`` option's fast recipe, else tq2_0.

    ``warnings`` are filled in by `check_request` (a type the target runs slowly)."""

    source: str
    recipe: str | None = None
    priority: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def read_manifest(path: Path, default_recipe: str | None, default_priority: int,
                  default_options: Mapping[str, Any] | None = None) -> list[JobRequest]:
    """Jobs from a YAML or JSON manifest: a list of sources, or of {source, recipe, target, priority,
    options}.

    The list may also sit under a top-level `jobs:` key. Every entry is checked as a job would
    be (`check_request`); errors name the entry at fault. `default_options` (the command line's)
    apply to every entry; an entry's own options win.
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
    return [_manifest_entry(path, index, item, default_recipe, default_priority, default_options or {})
            for index, item in enumerate(data, 1)]


def _manifest_entry(path: Path, index: int, item: Any, recipe: str | None, priority: int,
                    default_options: Mapping[str, Any]) -> JobRequest:
    if isinstance(item, str):
        item = {"source": item}
    if not isinstance(item, dict) or not isinstance(item.get("source"), str) or not item["source"].strip():
        raise InputError(f"manifest {path}, entry {index}: needs a `source` string, got {_SHORT.repr(item)}")
    unknown = sorted(key[:80] if isinstance(key, str) else _SHORT.repr(key)
                     for key in set(item) - _MANIFEST_KEYS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], _MANIFEST_KEYS, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"manifest {path}, entry {index}: unknown keys {unknown[:8]}{hint}; "
                         f"allowed: {sorted(_MANIFEST_KEYS)} (job options go under `options:`)")
    if not isinstance(item.get("recipe", recipe), (str, type(None))):
        raise InputError(f"manifest {path}, entry {index}: recipe must be a string")
    given = item.get("priority", priority)
    if not isinstance(given, int) or isinstance(given, bool):
        raise InputError(f"manifest {path}, entry {index}: priority must be an integer")
    options = item.get("options", {})
    if not isinstance(options, dict):
        raise InputError(f"manifest {path}, entry {index}: options must be a mapping")
    _check_options(options, f"manifest {path}, entry {index}")
    options = {**default_options, **options}
    if "target" in item:
        options["target"] = item["target"]
    request = JobRequest(item["source"].strip(), item.get("recipe", recipe), item.get("priority", priority),
                         options)
    try:
        return check_request(request)
    except InputError as exc:
        raise InputError(f"manifest {path}, entry {index}: {exc}") from exc


# Bounds on what a submitter may store: priorities fit the database's integer column with room to
# spare, and options (the calibration text is the large one, at most 1 MiB) stay a small row.
PRIORITY_MIN, PRIORITY_MAX = -1_000_000, 1_000_000
_MAX_OPTIONS_BYTES = 2 << 20
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


def check_request(request: JobRequest) -> JobRequest:
    """The request as it will be recorded: recipe and options checked and normalised (one function for
    the CLI, manifests and the API, before any row exists); InputError names the fault and the fix.

    Options that look like secrets are refused: job options are stored and shown to every reader.
    """
    where = f"job for {escaped(request.source)}"
    _check_options(request.options, where)
    if isinstance(request.priority, bool) or not isinstance(request.priority, int) or not (
            PRIORITY_MIN <= request.priority <= PRIORITY_MAX):
        raise InputError(f"{where}: priority {_SHORT.repr(request.priority)} must be an integer from "
                         f"{PRIORITY_MIN} to {PRIORITY_MAX}")
    size = len(json.dumps(request.options, ensure_ascii=False).encode("utf-8"))
    if size > _MAX_OPTIONS_BYTES:
        raise InputError(f"{where}: options take {size} bytes as JSON, over the limit of "
                         f"{_MAX_OPTIONS_BYTES}; "
                         "pass a shorter calibration text or fewer options")
    if redact(request.options) != dict(request.options):
        raise InputError(
            f"{where}: options must not carry secrets (token, password…); "
            "the Hugging Face token belongs in BONSAI_HF_TOKEN on the workers"
        )
    checked = check_job_input(request.recipe, request.options)
    # What only a stage can say about its options (calibrate's text and bounds, validate's threshold
    # order, decompose's device): every stage's own reading, now, before a job row exists.
    spec = JobSpec(request.source, checked.recipe, checked.options)
    for stage in STAGE_ORDER:
        load_stage(stage).make_params(spec)
    return replace(request, recipe=checked.recipe, options=checked.options, warnings=checked.warnings)


def create_jobs(
    session: Session, requests: Sequence[JobRequest], submitted_by: str | None, policy: SourcePolicy,
    *, team: str | None = None, teams: Teams = NO_TEAMS, may_exceed_priority: bool = False,
) -> list[int]:
    """Record the jobs (checked first, so a bad one records none of them); returns their ids.

    `policy` says which local paths this submitter may name (the API: only under
    BONSAI_SOURCE_ROOTS); InputError names the first request it refuses. The jobs belong to ``team``
    (default: the submitter's own); its caps in ``teams`` refuse the whole submission (`team_caps`).
    """
    checked = [check_request(request) for request in requests]
    for request in checked:
        policy.check(request.source)
    team = team_of(submitted_by, team)
    team_caps.check_submission(session, team, teams.policy(team), [r.priority for r in checked],
                               may_exceed_priority)
    job_ids = []
    for r in checked:
        job_id = repo.create_job(session, r.source, r.recipe or "", r.options, r.priority, submitted_by,
                                 team).id
        actions.record(session, submitted_by, "submit", f"job {job_id}", job_id=job_id, team=team,
                       detail={"source": r.source, "recipe": r.recipe or "", "priority": r.priority})
        job_ids.append(job_id)
    return job_ids


def retry_job(session: Session, job_id: int, from_stage: StageName | None, force: bool,
              requested_by: str | None = None) -> list[int]:
    """New pending attempts for `from_stage` and every stage that depends on it; earlier attempts stay.

    Returns the new run ids; each records `requested_by` (who asked). Refuses while the job has an
    attempt queued or running.
    """
    job = repo.get_job(session, job_id)
    latest = repo.latest_runs(session, job_id)
    active = [s for s, run in latest.items() if run.status in (StageState.QUEUED, StageState.RUNNING)]
    states = {stage: run.status for stage, run in latest.items()}
    plan = plan_for(job.recipe, job.params)
    if from_stage is not None and from_stage not in plan.inputs:
        raise InputError(f"job {job_id} has no {from_stage.value} stage (its stages: "
                         f"{', '.join(s.value for s in plan.order)}); retry from one of those")
    stages = coordinator.retry_stages(states, from_stage, plan.order, plan.inputs)
    succeeded = job.status is JobState.SUCCEEDED
    # A succeeded job may still run a stage it did not need (calibrate started beside decompose): only a
    # retry that would run that stage again waits for it.
    if active and (not succeeded or set(active) & set(stages)):
        names = ", ".join(s.value for s in active)
        if succeeded:
            raise InputError(f"job {job_id} succeeded, but its {names} still runs in the background (started "
                             "beside decompose; the job did not need it, and its result is kept for later "
                             "jobs of this checkpoint); a retry that reruns it waits for it: wait, or retry "
                             "from a stage after it")
        raise InputError(f"job {job_id} has {names} queued or running; cancel it or wait")
    if not stages:
        raise InputError(_nothing_to_retry(job_id, plan))
    first = stages[0]
    upstream_missing = [s.value for s in upstream_of(first, plan.inputs)
                        if states.get(s) not in DONE_STATES]
    if upstream_missing:
        raise InputError(f"job {job_id}: cannot retry from {first.value} before "
                         f"{', '.join(upstream_missing)} succeeded; retry from {upstream_missing[0]}")
    released = [s.value for s in upstream_of(first, plan.inputs) if _released_outputs(latest[s])]
    if released:
        raise InputError(f"job {job_id}: `bonsai gc` removed the stored outputs of {', '.join(released)}, "
                         f"which {first.value} reads; retry from {released[0]} to make them again")
    run_ids = []
    for stage in stages:
        run = repo.new_attempt(session, job, stage)
        run.is_forced = force
        run.requested_by = requested_by
        run_ids.append(run.id)
    if job.status is not JobState.RUNNING:
        repo.set_job_state(session, job, JobState.RUNNING)
    actions.record(session, requested_by, "retry", f"job {job_id}", job_id=job_id,
                   detail={"from": first.value, "run_ids": run_ids, "force": force})
    return run_ids


def _nothing_to_retry(job_id: int, plan: JobPlan) -> str:
    """What a retry of a job whose every stage is done would rerun, stage by stage."""
    reruns = "; ".join(
        f"--from {stage.value} reruns {', '.join(s.value for s in downstream_of(stage, plan.inputs))}"
        for stage in plan.order)
    return f"job {job_id} has nothing to retry: every stage is done. {reruns}"


def _released_outputs(run: StageRun) -> bool:
    return any(link.direction == LinkDirection.OUT and link.artifact.released_at is not None
               for link in run.links)


def cancel_job(session: Session, job_id: int, cancelled_by: str = "user") -> list[str]:
    """Cancel the job and its unfinished attempts; returns task ids of attempts to revoke.
    The job's message names `cancelled_by`. A failed job can be cancelled too: it is given up (no
    retry is expected, so `bonsai gc` may take its bytes), and its message keeps the failure."""
    job = repo.get_job(session, job_id)
    if job.status is JobState.FAILED:
        repo.set_job_state(session, job, JobState.CANCELLED,
                           error_message=f"cancelled by {cancelled_by} after it failed: {job.error_message}")
        actions.record(session, cancelled_by, "cancel", f"job {job_id}", job_id=job_id,
                       detail={"after": "failed"})
        return []
    if job.status.is_final:
        raise InputError(f"job {job_id} is already {job.status}; nothing to cancel")
    revoke = []
    for run in job.stage_runs:
        if not run.status.is_final:
            if run.task_id:
                revoke.append(run.task_id)
            repo.set_stage_state(session, run, StageState.CANCELLED)
    repo.set_job_state(session, job, JobState.CANCELLED, error_message=f"cancelled by {cancelled_by}")
    actions.record(session, cancelled_by, "cancel", f"job {job_id}", job_id=job_id,
                   detail={"revoked": len(revoke)})
    return revoke
