"""The `bonsai` command line. Commands turn flags into calls; the work happens elsewhere.

Heavy libraries (torch, gguf, llama.cpp) are imported only inside the stages, so
`bonsai jobs` starts at once.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from pipeline.errors import PipelineError
from pipeline.settings import Settings

__all__ = ["main", "cli"]


@dataclass
class CliContext:
    settings: Settings

    def runtime(self) -> Any:
        from pipeline.bootstrap import build_runtime

        return build_runtime(self.settings)


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


@click.group()
@click.option("--home", type=click.Path(path_type=Path), envvar="BONSAI_HOME", help="Data folder (embedded mode).")
@click.option("--db-url", envvar="BONSAI_DATABASE_URL", help="SQLAlchemy database URL.")
@click.option("--broker-url", envvar="BONSAI_BROKER_URL", help="Celery broker URL (distributed mode).")
@click.option("--artifact-root", type=click.Path(path_type=Path), envvar="BONSAI_ARTIFACT_ROOT")
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level to stderr.")
@click.pass_context
def cli(
    ctx: click.Context,
    home: Path | None,
    db_url: str | None,
    broker_url: str | None,
    artifact_root: Path | None,
    verbose: bool,
) -> None:
    """Bonsai Pipeline: checkpoints to ternary GGUF, every step recorded."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = Settings.from_env(
            home=home, database_url=db_url, broker_url=broker_url, artifact_root=artifact_root
        ).validate_all()
    except PipelineError as exc:
        _fail(str(exc))
    ctx.obj = CliContext(settings)


def _guard(func: Callable[..., None]) -> Callable[..., None]:
    """Turn pipeline errors into one clear line and exit code 2, not a traceback."""

    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except PipelineError as exc:
            _fail(str(exc))

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper


def _parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            _fail(f"--option {pair!r} must look like KEY=VALUE")
        key, raw = pair.split("=", 1)
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


@cli.command()
@click.argument("source")
@click.option("--recipe", default="tq2_0", show_default=True, help="Named recipe (tq2_0, tq1_0).")
@click.option("--option", "options", multiple=True, help="Recipe knob KEY=VALUE (repeatable).")
@click.option("--out", type=click.Path(path_type=Path), help="Also copy the GGUF here.")
@click.option("--json", "as_json", is_flag=True, help="Print the job detail as JSON at the end.")
@click.pass_obj
@_guard
def convert(obj: CliContext, source: str, recipe: str, options: tuple[str, ...], out: Path | None,
            as_json: bool) -> None:
    """Convert SOURCE in this process (embedded mode), with progress."""
    from pipeline.convert import convert_source

    if out is not None and out.exists():
        _fail(f"--out {out} already exists; choose a new path (artifacts are never overwritten)")
    code = convert_source(obj.runtime(), source, recipe, _parse_options(options), out, as_json)
    sys.exit(code)


@cli.command()
@click.option("--status", "status", default=None, help="Only jobs in this state.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@_guard
def jobs(obj: CliContext, status: str | None, as_json: bool) -> None:
    """List jobs."""
    from pipeline.reports import print_jobs

    print_jobs(obj.runtime(), status, as_json)


@cli.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@_guard
def show(obj: CliContext, job_id: int, as_json: bool) -> None:
    """One job: stages, every attempt, artifacts and the validation result."""
    from pipeline.reports import print_job

    print_job(obj.runtime(), job_id, as_json)


@cli.command("demo-checkpoint")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--layers", default=2, show_default=True, help="Transformer blocks.")
@_guard
def demo_checkpoint(dest: Path, layers: int) -> None:
    """Write the small ternary-trained-style Llama demo checkpoint into DEST."""
    from pipeline.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(dest, n_layers=layers)
    click.echo(f"demo checkpoint written to {folder}")


@cli.group()
def db() -> None:
    """Database maintenance."""


@db.command("upgrade")
@click.pass_obj
@_guard
def db_upgrade(obj: CliContext) -> None:
    """Apply Alembic migrations up to the newest revision."""
    from pipeline.bootstrap import migrate_database

    url = migrate_database(obj.settings)
    click.echo(f"database at {url} is up to date")


def main() -> None:
    cli(prog_name="bonsai")
