"""What `bonsai logs JOB` prints: every attempt's log lines, warnings and error, oldest first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.app.terminal import printable
from pipeline.core.states import STAGE_ORDER, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.runtime import Runtime

__all__ = ["attempt_logs", "print_logs"]


def _entry(session: Any, run: StageRun) -> dict[str, Any]:
    source = session.get(StageRun, run.cached_from_id) if run.cached_from_id else None
    return {
        "cached_from_job_id": source.job_id if source is not None else None,
        "run_id": run.id, "stage": run.stage, "attempt": run.attempt, "shard": run.shard or None,
        "status": run.status, "worker_host": run.worker_host, "duration_s": run.duration_s,
        "cached_from_id": run.cached_from_id, "lines": (run.log_text or "").splitlines(),
        "warnings": list(run.warnings or []), "error_message": run.error_message,
    }


def attempt_logs(
    rt: Runtime, job_id: int, stage: StageName | None, attempt: int | None
) -> list[dict[str, Any]]:
    """The attempts of `job_id` (of `stage`, of number `attempt`) with their logs, in stage order."""
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        runs = sorted(job.stage_runs,
                      key=lambda r: (STAGE_ORDER.index(r.stage), r.attempt, r.shard))
        wanted = [run for run in runs if (stage is None or run.stage == stage.value)
                  and (attempt is None or run.attempt == attempt)]
        return [_entry(session, run) for run in wanted]


def _header(entry: dict[str, Any]) -> str:
    shard = f" shard {entry['shard']}" if entry["shard"] else ""
    took = f" in {entry['duration_s']:.2f}s" if entry["duration_s"] is not None else ""
    where = f" on {entry['worker_host']}" if entry["worker_host"] else ""
    return f"== {entry['stage']} attempt {entry['attempt']}{shard} (run {entry['run_id']}): " \
           f"{entry['status']}{took}{where}"


def print_logs(entries: list[dict[str, Any]], echo: Callable[[str], None] = print) -> None:
    for entry in entries:
        echo(_header(entry))
        if entry["status"] == StageState.SKIPPED_CACHED.value:
            origin = f"bonsai logs {entry['cached_from_job_id']} --stage {entry['stage']}"
            echo(f"   served from the cache: nothing ran; the outputs of run {entry['cached_from_id']} "
                 f"were reused (its lines: `{origin}`)")
        elif not entry["lines"] and entry["status"] in (StageState.PENDING.value, StageState.QUEUED.value):
            echo("   not started yet")
        elif not entry["lines"] and entry["status"] == StageState.RUNNING.value:
            echo("   running: its lines are kept when the attempt ends")
        for line in entry["lines"]:
            echo(f"   {printable(line)}")
        for warning in entry["warnings"]:
            echo(f"   warning: {printable(warning)}")
        if entry["error_message"]:
            echo(f"   error: {printable(entry['error_message'])}")
