"""Commands about jobs: convert, submit, list, show, cancel, and the demo checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from pipeline.app.cli.help import ListsRecipes
from pipeline.app.cli.main import (
    TARGET_CHOICES,
    CliContext,
    cli,
    cli_actor,
    command_prefix,
    fail,
    guard,
    missing_home,
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


@cli.command(cls=ListsRecipes)
@click.argument("source")
@click.option("--recipe", default=None,
              help="Named recipe (listed below; default: tq2_0, or the fast one for --target).")
@click.option("--target", type=click.Choice(TARGET_CHOICES), default=None,
              help="Where the GGUF will run: picks the default recipe and warns about slow types.")
@click.option("--option", "options", multiple=True, help="Job option KEY=VALUE (repeatable; listed below).")
@click.option("--calibration", "calibration", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Calibration text (UTF-8) for recipes that use one (importance=imatrix, method=gptq); "
                   "default: the built-in text.")
@click.option("--out", type=click.Path(),
              help="Where the GGUF goes: a file, or a folder (made if missing) for <model>-<TYPE>.gguf "
                   "[default: the current folder].")
@click.option("--force", is_flag=True, help="Replace an existing output file instead of choosing a new name.")
@click.option("--json", "as_json", is_flag=True, help="Print the job detail as JSON at the end.")
@click.pass_obj
@guard
def convert(obj: CliContext, source: str, recipe: str | None, target: str | None, options: tuple[str, ...],
            calibration: Path | None, out: str | None, force: bool, as_json: bool) -> None:
    """Convert SOURCE in this process (embedded mode), with progress.

    The GGUF is copied out as <model>-<TYPE>.gguf (never over an existing file without
    --force); when validation fails it is not, and `bonsai export JOB --force` takes it.
    """
    from pipeline.app import outputs
    from pipeline.app.convert import convert_source

    plan = outputs.plan(out, force, obj.settings.output_dir or Path.cwd())
    knobs = _with_calibration(parse_options(options, target), calibration)
    code = convert_source(obj.runtime(), source, recipe, knobs, plan, as_json, command_prefix(obj),
                          actor=cli_actor(), team=obj.settings.team or None)
    sys.exit(code)


@cli.command()
@click.option("--status", "status", default=None, help="Only jobs in this state.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def jobs(obj: CliContext, status: str | None, as_json: bool) -> None:
    """List jobs."""
    from pipeline.app.reports import print_jobs

    why = missing_home(obj)
    if why:
        click.echo(why, err=True)
        if as_json:
            click.echo("[]")
        return
    print_jobs(obj.runtime(), status, as_json)


@cli.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@click.option("--against", type=int, default=None, metavar="OTHER",
              help="also show which tensors' types differ from job OTHER's auto allocation, and which way")
@click.pass_obj
@guard
def show(obj: CliContext, job_id: int, as_json: bool, against: int | None) -> None:
    """One job: stages, every attempt, artifacts and the validation result."""
    from pipeline.app.reports import print_job

    why = missing_home(obj)
    if why:
        fail(f"job {job_id} does not exist: {why}")
    print_job(obj.runtime(), job_id, as_json, against)


@cli.command(cls=ListsRecipes)
@click.argument("sources", nargs=-1)
@click.option("--manifest", type=click.Path(path_type=Path, dir_okay=False),
              help="YAML or JSON list of jobs (see the README).")
@click.option("--recipe", default=None,
              help="Named recipe (listed below; default: tq2_0, or the fast one for --target); "
                   "a manifest entry's own recipe wins.")
@click.option("--target", type=click.Choice(TARGET_CHOICES), default=None,
              help="Where the GGUFs will run: picks the default recipe and warns about slow types.")
@click.option("--priority", default=0, show_default=True, help="Higher runs sooner.")
@click.option("--option", "options", multiple=True, help="Job option KEY=VALUE (repeatable; listed below).")
@click.option("--calibration", "calibration", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Calibration text (UTF-8) for recipes that use one (importance=imatrix, method=gptq); "
                   "default: the built-in text.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def submit(obj: CliContext, sources: tuple[str, ...], manifest: Path | None, recipe: str | None,
           target: str | None, priority: int, options: tuple[str, ...], calibration: Path | None,
           as_json: bool) -> None:
    """Record jobs and dispatch them to workers; prints the job ids."""
    from pipeline.orchestration.job_control import JobRequest, check_request, read_manifest

    require_broker(obj, "submit")
    # Checked here, before the broker or the database is touched: a typo costs nothing.
    given = _with_calibration(parse_options(options, target), calibration)
    requests = [check_request(JobRequest(s, recipe, priority, given)) for s in sources]
    if manifest is not None:
        requests += read_manifest(manifest, recipe, priority, given)
    if not requests:
        fail("nothing to submit: give SOURCE arguments or --manifest FILE")
    from pipeline.orchestration.launcher import submit_jobs

    job_ids = submit_jobs(obj.runtime(), requests, cli_actor(), obj.source_policy(),
                          team=obj.settings.team or None)
    for job_id, request in zip(job_ids, requests, strict=True):
        for warning in request.warnings:
            click.echo(f"warning: job {job_id}: {warning}", err=True)
    click.echo(json.dumps({"job_ids": job_ids}) if as_json else "\n".join(map(str, job_ids)))


@cli.command()
@click.argument("job_id", type=int)
@click.pass_obj
@guard
def cancel(obj: CliContext, job_id: int) -> None:
    """Stop a job: unfinished attempts are cancelled and running tasks revoked.

    A failed job is given up instead: no retry is expected, so `bonsai gc` may take its bytes."""
    from pipeline.db.session import session_scope
    from pipeline.orchestration.job_control import cancel_job

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        task_ids = cancel_job(session, job_id, cancelled_by="cli")
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
