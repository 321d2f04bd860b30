"""Commands about jobs: convert, submit, list, show, cancel, and the demo checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from pipeline.app.cli.main import (
    CliContext,
    cli,
    fail,
    guard,
    parse_options,
    require_broker,
)


def _with_calibration(options: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The options with ``calibration_text`` read from ``path`` (the job stores the text itself, so
    its digest keys calibrate's cache and its provenance records it)."""
    if path is None:
        return options
    from pipeline.calibration.text import read_calibration_file

    return {**options, "calibration_text": read_calibration_file(path)}


@cli.command()
@click.argument("source")
@click.option("--recipe", default="tq2_0", show_default=True, help="Named recipe (tq2_0, tq1_0).")
@click.option("--option", "options", multiple=True, help="Recipe knob KEY=VALUE (repeatable).")
@click.option("--calibration", "calibration", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Calibration text (UTF-8) for recipes that use one (importance=imatrix, method=gptq); "
                   "default: the built-in text.")
@click.option("--out", type=click.Path(path_type=Path), help="Also copy the GGUF here.")
@click.option("--json", "as_json", is_flag=True, help="Print the job detail as JSON at the end.")
@click.pass_obj
@guard
def convert(obj: CliContext, source: str, recipe: str, options: tuple[str, ...], calibration: Path | None,
            out: Path | None, as_json: bool) -> None:
    """Convert SOURCE in this process (embedded mode), with progress."""
    from pipeline.app.convert import convert_source

    if out is not None and out.exists():
        fail(f"--out {out} already exists; choose a new path (artifacts are never overwritten)")
    knobs = _with_calibration(parse_options(options), calibration)
    code = convert_source(obj.runtime(), source, recipe, knobs, out, as_json)
    sys.exit(code)


@cli.command()
@click.option("--status", "status", default=None, help="Only jobs in this state.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def jobs(obj: CliContext, status: str | None, as_json: bool) -> None:
    """List jobs."""
    from pipeline.app.reports import print_jobs

    print_jobs(obj.runtime(), status, as_json)


@cli.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def show(obj: CliContext, job_id: int, as_json: bool) -> None:
    """One job: stages, every attempt, artifacts and the validation result."""
    from pipeline.app.reports import print_job

    print_job(obj.runtime(), job_id, as_json)


@cli.command()
@click.argument("sources", nargs=-1)
@click.option("--manifest", type=click.Path(path_type=Path, dir_okay=False),
              help="YAML or JSON list of jobs.")
@click.option("--recipe", default="tq2_0", show_default=True)
@click.option("--priority", default=0, show_default=True, help="Higher runs sooner.")
@click.option("--option", "options", multiple=True, help="Recipe knob KEY=VALUE (repeatable).")
@click.option("--calibration", "calibration", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Calibration text (UTF-8) for recipes that use one (importance=imatrix, method=gptq); "
                   "default: the built-in text.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def submit(obj: CliContext, sources: tuple[str, ...], manifest: Path | None, recipe: str, priority: int,
           options: tuple[str, ...], calibration: Path | None, as_json: bool) -> None:
    """Record jobs and dispatch them to workers; prints the job ids."""
    from pipeline.orchestration.job_control import JobRequest, read_manifest

    require_broker(obj, "submit")
    knobs = _with_calibration(parse_options(options), calibration)
    requests = [JobRequest(s, recipe, priority, knobs) for s in sources]
    if manifest is not None:
        requests += read_manifest(manifest, recipe, priority)
    if not requests:
        fail("nothing to submit: give SOURCE arguments or --manifest FILE")
    from pipeline.orchestration.launcher import submit_jobs

    job_ids = submit_jobs(obj.runtime(), requests, "cli:submit", obj.source_policy())
    click.echo(json.dumps({"job_ids": job_ids}) if as_json else "\n".join(map(str, job_ids)))


@cli.command()
@click.argument("job_id", type=int)
@click.pass_obj
@guard
def cancel(obj: CliContext, job_id: int) -> None:
    """Stop a job: unfinished attempts are cancelled and running tasks revoked."""
    from pipeline.db.session import session_scope
    from pipeline.orchestration.job_control import cancel_job

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        task_ids = cancel_job(session, job_id)
    rt.launcher.revoke(task_ids)
    click.echo(f"job {job_id} cancelled ({len(task_ids)} task(s) revoked)")


@cli.command("demo-checkpoint")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--layers", default=2, show_default=True, help="Transformer blocks.")
@click.option(
    "--architecture",
    default="llama",
    show_default=True,
    type=click.Choice(["llama", "mistral", "qwen2", "qwen3", "bitnet"]),
    help="Which HF architecture (and its usual tokenizer kind) the demo imitates.",
)
@guard
def demo_checkpoint(dest: Path, layers: int, architecture: str) -> None:
    """Write a small ternary-trained-style demo checkpoint (Llama unless --architecture) into DEST."""
    from pipeline.demo.checkpoint import write_demo_checkpoint

    folder = write_demo_checkpoint(dest, n_layers=layers, architecture=architecture)
    click.echo(f"demo checkpoint written to {folder}")
