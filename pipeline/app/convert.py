"""`bonsai convert`: submit a job and run it in this process, showing each stage as it goes.

At the end the GGUF is copied out of the store under a readable name (`outputs`); when
validation fails it is not, and the summary says where the packaged file is and which
command takes it anyway (`bonsai export JOB --force`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeline.app import outputs, views
from pipeline.app.terminal import markup_safe as safe
from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.orchestration.embedded import StageEvent, run_job
from pipeline.orchestration.job_control import JobRequest, check_request, create_jobs
from pipeline.orchestration.runtime import Runtime
from pipeline.stages.sources import SourcePolicy

__all__ = ["convert_source", "run_and_report", "output_name"]

_MARKS = {
    StageState.SUCCEEDED: "[green]ok[/green]",
    StageState.SKIPPED_CACHED: "[cyan]cached[/cyan]",
    StageState.FAILED: "[red]FAILED[/red]",
    StageState.CANCELLED: "[yellow]cancelled[/yellow]",
    StageState.NOT_NEEDED: "[dim]not needed[/dim] (the conversion is bit-exact: no source run)",
}


def convert_source(
    rt: Runtime, source: str, recipe: str | None, options: dict[str, Any], out: outputs.OutputPlan | None,
    as_json: bool, command: str = "bonsai", *, actor: str = "cli:convert", team: str | None = None,
) -> int:
    """Submit one job as ``actor`` of ``team`` and run it in-process; returns the exit code (0 when it
    succeeded).

    `command` is how the user calls bonsai here (with ``--home`` when not the default), for the
    commands the summary suggests.
    """
    request = check_request(JobRequest(source, recipe, 0, options))
    with session_scope(rt.sessions) as session:
        policy = SourcePolicy.from_roots(rt.source_roots, allow_any_local=True)
        (job_id,) = create_jobs(session, [request], actor, policy, team=team, teams=rt.teams)
    console = Console(stderr=as_json, soft_wrap=True)
    console.print(f"job [bold]{job_id}[/bold]: converting {safe(source)} with recipe {request.recipe}")
    for warning in request.warnings:
        console.print(f"  [yellow]warning[/yellow] {safe(warning)}", highlight=False)
    return run_and_report(rt, job_id, as_json, out, command)


def output_name(job: Any) -> str:
    """``<model>-<TYPE>.gguf`` for a job row: the package stage's model name, the recipe's type."""
    from pipeline.stages.base import JobSpec
    from pipeline.stages.package.stage import make_params
    from pipeline.ternary.policy import get_recipe

    spec = JobSpec(job.source, job.recipe, dict(job.params or {}))
    ternary_type = get_recipe(job.recipe, spec.options).ternary_type
    return outputs.default_name(make_params(spec).model_name, ternary_type)


def _announce_compile(console: Console, recipe: str, params: dict[str, Any]) -> None:
    """Say so when decompose is about to compile its kernel; checked on a thread of its own, because
    reading numba's cache imports the kernel module (while the warm-up may hold its import lock),
    and the loop that starts the job's stages must not wait for a courtesy line."""
    threading.Thread(target=_announce_if_cold, args=(console, recipe, params), name="bonsai-announce",
                     daemon=True).start()


def _announce_if_cold(console: Console, recipe: str, params: dict[str, Any]) -> None:
    from pipeline.ternary import kernel_cache
    from pipeline.ternary.policy import get_recipe

    try:
        ggml_type = get_recipe(recipe, params).ternary_type
    except Exception:  # noqa: BLE001 - only a courtesy line; the stage reports real errors
        return
    if str(params.get("device", "auto")).startswith("cuda") or not kernel_cache.is_cold(ggml_type):
        return
    seconds = kernel_cache.COMPILE_ESTIMATE_S.get(ggml_type, 15)
    console.print(f"  decompose  compiling the ternary kernel once (about {seconds} s)...")


def run_and_report(rt: Runtime, job_id: int, as_json: bool, out: outputs.OutputPlan | None = None,
                   command: str = "bonsai") -> int:
    """Run a recorded job's remaining stages in-process, showing each; returns the exit code.

    With `out`, a succeeded job's GGUF is copied there (see `outputs`).
    """
    console = Console(stderr=as_json, soft_wrap=True)
    status = console.status("starting")
    status.start()
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        name, recipe, params = output_name(job), job.recipe, dict(job.params or {})

    running: list[str] = []  # stages that run side by side are all shown

    def on_event(event: StageEvent) -> None:
        if event.state is StageState.RUNNING:
            if event.stage is StageName.DECOMPOSE:
                _announce_compile(console, recipe, params)
            running.append(event.stage.value)
            status.update(f"{' + '.join(running)} running…")
            return
        if event.stage.value in running:
            running.remove(event.stage.value)
            status.update(f"{' + '.join(running)} running…" if running else "")
        took = f" in {event.duration_s:.2f}s" if event.duration_s is not None else ""
        console.print(f"  {event.stage.value:<10} {_MARKS.get(event.state, event.state.value)}{took}")
        if event.message:
            console.print(f"    [red]{safe(event.message)}[/red]", highlight=False)

    try:
        final = run_job(rt, job_id, on_event)
    finally:
        status.stop()
    with session_scope(rt.sessions) as session:
        detail = views.job_detail(repo.get_job(session, job_id), rt.store)
    written: Path | None = None
    if final is JobState.SUCCEEDED and out is not None and detail["gguf"]:
        written = outputs.deliver(out, rt.store.path(detail["gguf"]["sha256"]), name)
        detail["exported_to"] = str(written)
    if as_json:
        import json

        print(json.dumps(detail, indent=2, sort_keys=True, default=str))
    else:
        _print_summary(console, detail, written, out, command)
    return 0 if final is JobState.SUCCEEDED else 1


def _print_summary(console: Console, detail: dict[str, Any], written: Path | None,
                   out: outputs.OutputPlan | None, command: str) -> None:
    job_id = detail["id"]
    if detail["status"] != JobState.SUCCEEDED.value:
        console.print(f"[red]job {job_id} {detail['status']}[/red]: {safe(detail['error_message'])}",
                      highlight=False)
        if outputs.validation_failed(detail):
            stored = detail["gguf"].get("path") or detail["gguf"]["uri"]
            where = f" so it was not copied to {out.file or out.folder}" if out is not None else ""
            console.print(f"  the packaged GGUF is at {stored}", highlight=False)
            console.print(f"  validation failed,{where}; to take it anyway:", highlight=False)
            console.print(f"    {command} export {job_id} --out PATH --force", highlight=False)
        console.print(f"  details: {command} show {job_id}", highlight=False)
        return
    gguf = detail["gguf"]
    decompose = next(s for s in reversed(detail["stages"]) if s["stage"] == "decompose")
    validation = detail["validation"] or {}
    console.print(f"[green]job {job_id} succeeded[/green]")
    console.print(f"  gguf      {written or gguf.get('path') or gguf['uri']}", highlight=False)
    if written is not None and gguf.get("path"):
        console.print(f"  stored    {gguf['path']}", highlight=False)
    console.print(f"  sha256    {gguf['sha256']}  ({gguf['size_bytes']:,} bytes)")
    sparsity = decompose["metrics"].get("sparsity")
    if sparsity is not None:
        console.print(f"  sparsity  {sparsity:.1%} of ternary weights are zero")
    text, verdict = validation.get("text"), validation.get("verdict")
    console.print(f"  1+1=      {safe(repr(text))}  (verdict: {verdict})", highlight=False)
    for warning in detail.get("warnings") or ():
        console.print(f"  [yellow]warning[/yellow] {safe(warning)}", highlight=False)
    console.print(f"  the job:  {command} show {job_id}", highlight=False)
