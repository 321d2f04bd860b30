"""What `bonsai jobs` and `bonsai show` print: tables for people, stable JSON for scripts."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.app import views
from pipeline.app.allocation_diff import allocation_diff
from pipeline.app.outputs import validation_failed
from pipeline.app.terminal import markup_safe as safe
from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.orchestration.runtime import Runtime

__all__ = ["print_jobs", "print_job"]


def _dump(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _job_rows(rt: Runtime, status: str | None) -> list[dict[str, Any]]:
    with session_scope(rt.sessions) as session:
        return [views.job_summary(job) for job in repo.list_jobs(session, status)]


def _jobs_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("id", "status", "progress", "stage", "recipe", "priority", "source")
    for row in rows:
        done = int(row["progress"] * 20)
        bar = "█" * done + "·" * (20 - done)
        table.add_row(str(row["id"]), row["status"], f"{bar} {row['progress']:.0%}",
                      row["current_stage"] or "-", safe(row["recipe"]), str(row["priority"]),
                      safe(row["source"]))
    return table


def print_jobs(rt: Runtime, status: str | None, as_json: bool) -> None:
    rows = _job_rows(rt, status)
    if as_json:
        _dump(rows)
        return
    Console().print(_jobs_table(rows))


def print_job(rt: Runtime, job_id: int, as_json: bool, against: int | None = None) -> None:
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        detail = views.job_detail(job, rt.store)
        views.add_waiting(detail, session, job, rt)
        if against is not None:
            detail["allocation_diff"] = allocation_diff(job, repo.get_job(session, against))
    if as_json:
        _dump(detail)
        return
    console = Console()
    console.print(f"job {detail['id']}  {detail['status']}  {safe(detail['source'])}  "
                  f"recipe {safe(detail['recipe'])}", highlight=False)
    if detail["error_message"]:
        console.print(f"[red]{safe(detail['error_message'])}[/red]", highlight=False)
    for stage, why in (detail.get("waiting") or {}).items():
        console.print(f"{stage} waits for a slot: {safe(why)}", highlight=False)
    for warning in detail.get("warnings") or ():
        console.print(f"[yellow]warning[/yellow] {safe(warning)}", highlight=False)
    if detail["options"]:
        options = Table("option", "value")
        for row in detail["options"]:
            shown = row["value"] + (" (whole: bonsai show --json, under params)" if row["long"] else "")
            options.add_row(safe(row["key"]), safe(shown))
        console.print(options)
    table = Table("stage", "attempt", "status", "took", "device", "asked by", "outputs")
    for run in detail["stages"]:
        took = f"{run['duration_s']:.2f}s" if run["duration_s"] is not None else "-"
        outputs = ", ".join(f"{o['name']} {o['sha256'][:12]}" for o in run["outputs"][:3])
        if len(run["outputs"]) > 3:
            outputs += f" (+{len(run['outputs']) - 3} more)"
        table.add_row(run["stage"], str(run["attempt"]), run["status"], took, safe(run["device"] or "-"),
                      safe(run["requested_by"] or "-"), safe(outputs))
    console.print(table)
    if detail["validation"]:
        validation = detail["validation"]
        console.print(f"validation: {validation.get('verdict')}  text={safe(repr(validation.get('text')))}",
                      highlight=False)
    if "allocation_diff" in detail:
        _print_diff(console, detail["allocation_diff"])
    if validation_failed(detail):
        where = detail["gguf"].get("path") or detail["gguf"]["uri"]
        console.print(f"the packaged GGUF is at {safe(where)}; to take it anyway: "
                      f"bonsai export {detail['id']} --out PATH --force", highlight=False, soft_wrap=True)


def _print_diff(console: Console, diff: dict[str, Any]) -> None:
    if "error" in diff:
        console.print(f"allocation against job {diff['against']}: {safe(diff['error'])}", highlight=False)
        return
    source = "" if diff["same_source"] else " (another source)"
    console.print(f"allocation against job {diff['against']}{source}: {len(diff['up'])} up, "
                  f"{len(diff['down'])} down, {diff['unchanged']} unchanged", highlight=False)
    table = Table("tensor", "was", "now", "moved")
    for way in ("down", "up"):
        for row in diff[way]:
            table.add_row(safe(row["tensor"]), row["from"], row["to"], way)
    if table.row_count:
        console.print(table)
