"""Plain-dict views of jobs, runs and artifacts: the stable `--json` shapes (add, never rename)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pipeline.artifacts.store import ArtifactStore, shareable_uri
from pipeline.core.errors import InputError
from pipeline.core.states import STAGE_ORDER, LinkDirection, StageName, StageState
from pipeline.core.teams import Teams
from pipeline.db import team_usage
from pipeline.db.models import Action, Job, StageRun, as_utc, utcnow
from pipeline.orchestration import admission, coordinator
from pipeline.orchestration.plan import plan_for
from pipeline.orchestration.runtime import Runtime

__all__ = ["job_summary", "job_detail", "run_view", "option_rows", "action_rows", "history_since",
           "LONG_OPTION_CHARS"]

# An option value longer than this (or of more than one line) is shown as its size, digest and first
# line: a calibration text or a manifest entry would otherwise fill the page and the terminal.
LONG_OPTION_CHARS = 80


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _latest(job: Job) -> dict[StageName, StageRun]:
    latest: dict[StageName, StageRun] = {}
    for run in sorted(job.stage_runs, key=lambda r: r.attempt):
        if not run.shard:  # shard children belong to their parent's attempt
            latest[run.stage] = run
    return latest


def job_summary(job: Job) -> dict[str, Any]:
    from pipeline.stages.options import job_warnings

    latest = _latest(job)
    states = {stage: run.status for stage, run in latest.items()}
    plan = plan_for(job.recipe, job.params, latest)
    current = coordinator.frontier(states, plan.waits_for(spare_workers=False), plan.stages)
    return {
        "id": job.id,
        "source": job.source,
        "resolved_revision": job.resolved_revision,
        "recipe": job.recipe,
        "params": job.params,
        "target": (job.params or {}).get("target"),
        # A type the target runs slowly or not at all (from the recipe; see ternary.backends).
        "warnings": job_warnings(job.recipe, job.params or {}),
        "status": job.status,
        "priority": job.priority,
        "submitted_by": job.submitted_by,
        "team": job.team,
        "progress": round(coordinator.progress(states, plan.order), 3),
        "current_stage": current.current.value if current.current else None,
        "error_message": job.error_message,
        "created_at": _time(job.created_at),
        "started_at": _time(job.started_at),
        "finished_at": _time(job.finished_at),
    }


def waiting_by_run(session: Any, teams: Teams, heartbeat_timeout_s: float) -> dict[int, str]:
    """Why each attempt waiting for admission waits, by run id (distributed mode)."""
    since = utcnow() - timedelta(seconds=heartbeat_timeout_s)
    return admission.waiting_reasons(session, teams, since)


def add_waiting(detail: dict[str, Any], session: Any, job: Job, rt: Runtime) -> None:
    """With workers (distributed mode), ``detail["waiting"]``: why each of the job's attempts that wait
    for admission waits, by stage."""
    if rt.launcher is None or rt.launcher.is_embedded:
        return
    detail["waiting"] = {}
    if not any(run.ready_at is not None and run.status is StageState.PENDING for run in job.stage_runs):
        return
    why = waiting_by_run(session, rt.teams, rt.heartbeat_timeout_s)
    detail["waiting"] = {str(run.stage): why[run.id] for run in job.stage_runs if run.id in why}


def team_rows(session: Any, teams: Teams) -> list[dict[str, Any]]:
    """Per team (each configured one, and each with work or stored bytes): what it holds now, its share
    of the attempts in flight, its decayed usage, its caps and how much of its quota it uses."""
    usage = team_usage.usage_by_team(session, teams.usage_half_life_s, teams.policies)
    total = sum(use.in_flight for use in usage.values())
    weights = sum(teams.policy(team).weight for team in usage)
    rows = []
    for team, use in usage.items():
        policy = teams.policy(team)
        quota = policy.storage_quota_bytes
        rows.append({
            "team": team, "running": use.in_flight, "waiting": use.waiting,
            "pending_jobs": use.unfinished_jobs,
            "share": round(use.in_flight / total, 3) if total else 0.0,
            "weighted_share": round(policy.weight / weights, 3),
            "usage_s": round(use.usage_s, 1), "stored_bytes": use.stored_bytes,
            # A quota of 0 is used up from the start.
            "quota_used": None if quota is None else (use.stored_bytes / quota if quota else 1.0),
            **policy.describe(),
        })
    return rows


def run_view(run: StageRun, store: ArtifactStore | None = None) -> dict[str, Any]:
    def artifact(link: Any) -> dict[str, Any]:
        item = link.artifact
        view = {
            "name": link.name,
            "sha256": item.sha256,
            "size_bytes": item.size_bytes,
            "kind": item.kind,
            "media_type": item.media_type,
            "uri": shareable_uri(item.uri, item.sha256),
            # False once `bonsai gc` removed the bytes (the record and its lineage stay).
            "retained": item.released_at is None,
        }
        # Only a path already on this machine: showing a job must not download its artifacts.
        local = store.local_path(item.sha256) if store is not None else None
        if local is not None:
            view["path"] = str(local)
        return view

    # Without a store (the API) no server internal is shown: a worker by its name, not its process id.
    worker = run.worker_host
    if store is None and worker and worker.rpartition(":")[2].isdigit():
        worker = worker.rpartition(":")[0]

    return {
        "id": run.id,
        "stage": run.stage,
        "attempt": run.attempt,
        "shard": run.shard or None,
        "parent_run_id": run.parent_run_id,
        "status": run.status,
        "worker_host": worker,
        "device": run.device,
        "cache_key": run.cache_key,
        "cached_from_id": run.cached_from_id,
        "requested_by": run.requested_by,
        "error_kind": run.error_kind,
        "error_message": run.error_message,
        "metrics": run.metrics,
        "warnings": run.warnings,
        "queued_at": _time(run.queued_at),
        "started_at": _time(run.started_at),
        "finished_at": _time(run.finished_at),
        "duration_s": run.duration_s,
        "inputs": [artifact(link) for link in run.links if link.direction == LinkDirection.IN],
        "outputs": [artifact(link) for link in run.links if link.direction == LinkDirection.OUT],
    }


def option_rows(params: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The job's options as rows to show: ``key``, ``value`` (the text shown) and ``long``; a long value
    is shown as its size, sha256 and first line, and ``params`` keeps it whole."""
    rows = []
    for key, value in sorted((params or {}).items()):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(text) <= LONG_OPTION_CHARS and "\n" not in text:
            rows.append({"key": key, "value": text, "long": False})
            continue
        data = text.encode("utf-8")
        first = text.strip().split("\n", 1)[0]
        if len(first) > LONG_OPTION_CHARS:
            first = first[:LONG_OPTION_CHARS - 1] + "…"
        digest = hashlib.sha256(data).hexdigest()
        rows.append({"key": key, "value": f"{len(data):,} bytes, sha256 {digest[:12]}, first line: {first!r}",
                     "long": True, "size_bytes": len(data), "sha256": digest, "first_line": first})
    return rows


def action_rows(rows: Sequence[Action]) -> list[dict[str, Any]]:
    """The action account's rows as shown (`bonsai history`, GET /api/history)."""
    return [{"id": row.id, "at": _time(row.at), "actor": row.actor, "team": row.team, "action": row.action,
             "target": row.target, "job_id": row.job_id, "outcome": row.outcome, "detail": row.detail}
            for row in rows]


def history_since(text: str | None) -> datetime | None:
    """``since`` as given (ISO 8601; a time without a zone is UTC); InputError naming the form."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InputError(f"since={text!r} is not a time; give ISO 8601, e.g. 2026-12-07 or "
                         "2026-12-07T09:30:00+00:00") from None
    return as_utc(moment)


def job_detail(job: Job, store: ArtifactStore | None = None) -> dict[str, Any]:
    """A job with every attempt of every stage, their artifacts, and the validation result."""
    detail = job_summary(job)
    detail["options"] = option_rows(job.params)
    runs = sorted(job.stage_runs, key=lambda r: (STAGE_ORDER.index(r.stage), r.id))
    detail["stages"] = [run_view(run, store) for run in runs]
    latest = _latest(job)
    validate = latest.get(StageName.VALIDATE)
    detail["validation"] = validate.metrics if validate is not None else None
    package = latest.get(StageName.PACKAGE)
    gguf = None
    if package is not None:
        outputs = run_view(package, store)["outputs"]
        gguf = next((out for out in outputs if out["kind"] == "gguf"), None)
    detail["gguf"] = gguf
    return detail


def worker_rows(session: Any, timeout_s: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Every worker row as shown to people (live, stopped or lost), and the queues no live worker serves."""
    from pipeline.db import repo
    from pipeline.db.models import utcnow
    from pipeline.orchestration.queues import QUEUES

    now = utcnow()
    rows, served = [], set()
    for worker in repo.all_workers(session):
        age_s = (now - as_utc(worker.heartbeat_at)).total_seconds()
        state = "stopped" if worker.stopped_at else "live" if age_s <= timeout_s else "lost"
        if state == "live":
            served.update(worker.queues)
        rows.append({"name": worker.name, "hostname": worker.hostname, "pid": worker.pid, "state": state,
                     "queues": list(worker.queues), "concurrency": worker.concurrency,
                     "memory_limit_mb": worker.memory_limit_mb,
                     "held_task_ids": list(worker.held_task_ids), "started_at": worker.started_at,
                     "heartbeat_at": worker.heartbeat_at, "heartbeat_age_s": round(age_s, 1)})
    return rows, [queue for queue in QUEUES if queue not in served]
