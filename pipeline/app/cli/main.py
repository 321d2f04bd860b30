"""The `bonsai` command group and what every command shares: settings, the runtime, clean errors.

Commands turn flags into calls; the work happens in the layers below. Heavy libraries
(torch, gguf, llama.cpp, Celery) are imported only inside the commands that need them, so
`bonsai jobs` starts at once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from pipeline.core.errors import PipelineError
from pipeline.core.settings import Settings

__all__ = [
    "cli", "CliContext", "fail", "guard", "echo_json", "parse_options", "stage_names", "require_broker",
    "exit_now",
    "command_prefix", "missing_home", "cli_actor", "TARGET_CHOICES",
]

# The backends `--target` names (ternary.backends.TARGETS; spelled here so `bonsai jobs` imports nothing).
TARGET_CHOICES = ("cpu", "cuda", "metal", "vulkan")


@dataclass
class CliContext:
    settings: Settings

    def runtime(self) -> Any:
        """The runtime (database, store, launcher) these settings call for, built on first use."""
        from pipeline.orchestration.bootstrap import build_runtime

        return build_runtime(self.settings)

    def source_policy(self) -> Any:
        """What local paths this machine's user may name: any readable one, unless roots are set."""
        from pipeline.stages.sources import SourcePolicy

        return SourcePolicy.from_roots(self.settings.source_root_list, allow_any_local=True)


def fail(message: str, code: int = 2) -> None:
    """Print one clear error line and exit (never a traceback)."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def cli_actor() -> str:
    """Who a CLI command records as having acted (a pin's holder, the action account): cli:USER."""
    import getpass

    return f"cli:{getpass.getuser()}"


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


@click.group()
@click.option("--home", type=click.Path(path_type=Path), envvar="BONSAI_HOME",
              help="Data folder (embedded mode).")
@click.option("--db-url", envvar="BONSAI_DATABASE_URL", help="SQLAlchemy database URL.")
@click.option("--broker-url", envvar="BONSAI_BROKER_URL", help="Celery broker URL (distributed mode).")
@click.option("--artifact-root", envvar="BONSAI_ARTIFACT_ROOT", help="Store folder, or s3://bucket/prefix.")
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level to stderr.")
@click.pass_context
def cli(
    ctx: click.Context,
    home: Path | None,
    db_url: str | None,
    broker_url: str | None,
    artifact_root: str | None,
    verbose: bool,
) -> None:
    """Bonsai Pipeline: checkpoints to ternary GGUF, every step recorded."""
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # the level is the console's: attempts keep INFO lines
        handler.setLevel(level)
    try:
        settings = Settings.from_env(
            home=home, database_url=db_url, broker_url=broker_url, artifact_root=artifact_root
        ).validate_all()
    except PipelineError as exc:
        fail(str(exc))
    ctx.obj = CliContext(settings)

def guard(func: Callable[..., None]) -> Callable[..., None]:
    """Turn pipeline errors into one clear line and exit code 2, not a traceback."""

    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            func(*args, **kwargs)
        except PipelineError as exc:
            fail(str(exc))

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper

def stage_names() -> list[Any]:
    from pipeline.core.states import STAGE_ORDER

    return list(STAGE_ORDER)

def parse_options(pairs: tuple[str, ...], target: str | None = None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as text; the option table (`stages.options`) gives each its kind."""
    options: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            fail(f"--option {pair!r} must look like KEY=VALUE")
        key, raw = pair.split("=", 1)
        options[key.strip()] = raw
    if target is not None:
        options["target"] = target
    return options


def missing_home(obj: CliContext) -> str | None:
    """Why there can be no jobs here (an embedded home whose database was never made), or None.

    Read-only commands say so instead of making an empty database in a folder nobody used."""
    settings = obj.settings
    if settings.database_url or not settings.is_embedded:
        return None
    database = (settings.home / "bonsai.db").resolve()
    if database.exists():
        return None
    return (f"no jobs here: there is no database at {database} (the home is {settings.home}; "
            "`bonsai convert` makes one; give --home or BONSAI_HOME to look at another)")


def command_prefix(obj: CliContext) -> str:
    """How to call bonsai on the same data again: ``--home`` when the home is not the default."""
    import shlex

    home = obj.settings.home
    return "bonsai" if home == Path(".bonsai") else f"bonsai --home {shlex.quote(str(home))}"

def require_broker(obj: CliContext, command: str) -> None:
    if obj.settings.is_embedded:
        fail(f"`bonsai {command}` needs a broker: set BONSAI_BROKER_URL or --broker-url "
              "(for one checkpoint without servers, use `bonsai convert`)")


def exit_now(code: str | int | None) -> None:
    """Leave with `code` (as sys.exit reads it) without the interpreter's teardown.

    Once torch and numba's threads are loaded, a normal exit spends ~2 s of a small job's
    time tearing them down (issue 14). Output and logs are flushed first and every database
    write has been committed by then; a command that left other threads running exits the
    ordinary way, so their work is not cut short.
    """
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what sys.exit does with a message
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 1  # a closed or broken pipe: report it, as the normal exit would
    os._exit(status)
