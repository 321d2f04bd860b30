"""`bonsai convert`: submit a job and run it in this process, showing each stage as it goes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeline.app import views
from pipeline.core.states import JobState, StageState
from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.orchestration.embedded import StageEvent, run_job
from pipeline.orchestration.job_control import JobRequest, create_jobs
from pipeline.orchestration.runtime import Runtime
from pipeline.stages.sources import SourcePolicy

__all__ = ["convert_source", "run_and_report"]

_MARKS = {
    StageState.SUCCEEDED: "[green]ok[/green]",
    StageState.SKIPPED_CACHED: "[cyan]cached[/cyan]",
    StageState.FAILED: "[red]FAILED[/red]",
    StageState.CANCELLED: "[yellow]cancelled[/yellow]",
}


def convert_source(
    rt: Runtime, source: str, recipe: str, options: dict[str, Any], out: Path | None, as_json: bool
) -> int:
    """Submit one job and run it in-process; returns the exit code (0 when it succeeded)."""
    with session_scope(rt.sessions) as session:
        policy = SourcePolicy.from_roots(rt.source_roots, allow_any_local=True)
        (job_id,) = create_jobs(session, [JobRequest(source, recipe, 0, options)], "cli:convert", policy)
    Console(stderr=as_json).print(f"job [bold]{job_id}[/bold]: converting {source} with recipe {recipe}")
    return run_and_report(rt, job_id, as_json, out)


def run_and_report(rt: Runtime, job_id: int, as_json: bool, out: Path | None = None) -> int:
    """Run a recorded job's remaining stages in-process, showing each; returns the exit code."""
    console = Console(stderr=as_json)
    status = console.status("starting")
    status.start()

    def on_event(event: StageEvent) -> None:
        if event.state is StageState.RUNNING:
            status.update(f"{event.stage.value} running…")
            return
        took = f" in {event.duration_s:.2f}s" if event.duration_s is not None else ""
        console.print(f"  {event.stage.value:<10} {_MARKS.get(event.state, event.state.value)}{took}")
        if event.message:
            console.print(f"    [red]{event.message}[/red]", highlight=False)

    try:
        final = run_job(rt, job_id, on_event)
    finally:
        status.stop()
    with session_scope(rt.sessions) as session:
        detail = views.job_detail(repo.get_job(session, job_id), rt.store)
    if final is JobState.SUCCEEDED and out is not None and detail["gguf"]:
        shutil.copyfile(rt.store.path(detail["gguf"]["sha256"]), out)
    if as_json:
        import json

        print(json.dumps(detail, indent=2, sort_keys=True, default=str))
    else:
        _print_summary(console, detail, out)
    return 0 if final is JobState.SUCCEEDED else 1


def _print_summary(console: Console, detail: dict[str, Any], out: Path | None) -> None:
    if detail["status"] != JobState.SUCCEEDED.value:
        console.print(f"[red]job {detail['id']} {detail['status']}[/red]: {detail['error_message']}")
        return
    gguf = detail["gguf"]
    decompose = next(s for s in reversed(detail["stages"]) if s["stage"] == "decompose")
    validation = detail["validation"] or {}
    console.print(f"[green]job {detail['id']} succeeded[/green]")
    console.print(f"  gguf      {out or gguf['path']}")
    console.print(f"  sha256    {gguf['sha256']}  ({gguf['size_bytes']:,} bytes)")
    sparsity = decompose["metrics"].get("sparsity")
    if sparsity is not None:
        console.print(f"  sparsity  {sparsity:.1%} of ternary weights are zero")
    text, verdict = validation.get("text"), validation.get("verdict")
    console.print(f"  1+1=      {text!r}  (verdict: {verdict})", highlight=False)
