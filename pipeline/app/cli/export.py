"""`bonsai export` (a job's GGUF under a readable name) and `bonsai recipes` (every recipe and option)."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.app.cli.main import CliContext, cli, echo_json, fail, guard


@cli.command()
@click.argument("job_id", type=int)
@click.option("--out", type=click.Path(),
              help="A file, or a folder (made if missing) for <model>-<TYPE>.gguf "
                   "[default: the current folder].")
@click.option("--force", is_flag=True,
              help="Take the GGUF even though validation failed, and replace an existing --out file.")
@click.pass_obj
@guard
def export(obj: CliContext, job_id: int, out: str | None, force: bool) -> None:
    """Copy JOB's GGUF out of the store, named <model>-<TYPE>.gguf; prints the path written."""
    from pipeline.app import outputs, views
    from pipeline.app.convert import output_name
    from pipeline.db import repo
    from pipeline.db.session import session_scope

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        detail = views.job_detail(job, rt.store)
        name = output_name(job)
    gguf = detail["gguf"]
    if not gguf:
        fail(f"job {job_id} ({detail['status']}) has no packaged GGUF yet; see `bonsai show {job_id}`")
    if detail["status"] != "succeeded":
        why = "failed validation" if outputs.validation_failed(detail) else f"is {detail['status']}"
        if not force:
            fail(f"job {job_id} {why}: {detail['error_message'] or 'not finished'}; "
                 "add --force to take its GGUF anyway")
        click.echo(f"warning: job {job_id} {why}; exporting its GGUF anyway (--force)", err=True)
    plan = outputs.plan(out, force, obj.settings.output_dir or Path.cwd())
    written = outputs.deliver(plan, rt.store.path(gguf["sha256"]), name)
    click.echo(str(written))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Recipes and options as JSON.")
def recipes(as_json: bool) -> None:
    """Every recipe (its type, bits per weight, where it runs fast) and every job option."""
    from pipeline.app.recipes import help_text, option_rows, recipe_rows

    if as_json:
        echo_json({"recipes": recipe_rows(), "options": option_rows()})
        return
    click.echo(help_text())
