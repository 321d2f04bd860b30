"""Commands that run services: worker, reconcile, serve, database upgrade, API tokens."""

from __future__ import annotations

import json
import logging

import click

from pipeline.app.cli.main import CliContext, cli, fail, guard, require_broker

log = logging.getLogger(__name__)


@cli.command()
@click.option("--queues", default="io,cpu,gpu", show_default=True, help="Comma-separated: io, cpu, gpu.")
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(1, 256))
@click.option("--hostname", default=None, help="Worker node name (default bonsai-QUEUES@host).")
@click.pass_obj
@guard
def worker(obj: CliContext, queues: str, concurrency: int, hostname: str | None) -> None:
    """Run a Celery worker for the given queues."""
    require_broker(obj, "worker")
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(wanted) - {"io", "cpu", "gpu"})
    if unknown or not wanted:
        fail(f"--queues {queues!r}: unknown queue(s) {unknown}; choose from io, cpu, gpu")
    from pipeline.orchestration.distributed import worker_process
    from pipeline.orchestration.distributed.celery_app import app_for
    from pipeline.orchestration.distributed.tasks import register_tasks

    worker_process.configure(obj.settings, concurrency)  # pool children are forked from this process
    worker_process.announce(wanted, concurrency)
    app = app_for(obj.settings)
    register_tasks(app)
    name = hostname or f"bonsai-{'-'.join(wanted)}@%h"
    for handler in logging.getLogger().handlers:  # the worker logs at --loglevel INFO, not the CLI's level
        handler.setLevel(logging.NOTSET)
    app.worker_main(["worker", "-Q", ",".join(wanted), "-c", str(concurrency), "-O", "fair",
                     "-n", name, "--loglevel", "INFO", "--without-gossip", "--without-mingle"])


@cli.command()
@click.option("--every", "every_s", type=float, default=None, help="Repeat every N seconds until stopped.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def reconcile(obj: CliContext, every_s: float | None, as_json: bool) -> None:
    """Re-dispatch stage runs whose message or worker was lost."""
    import time

    require_broker(obj, "reconcile")
    from pipeline.orchestration.distributed.reconcile import reconcile as reconcile_once

    rt = obj.runtime()
    while True:
        try:
            report = reconcile_once(rt, obj.settings).as_dict()
        except Exception as exc:  # noqa: BLE001 - a repeating reconciler outlives a database or broker blip
            if every_s is None:
                raise
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            log.warning("reconcile pass failed (%s: %s); trying again in %s s", type(exc).__name__,
                        first_line, every_s)
            time.sleep(every_s)
            continue
        if as_json:
            click.echo(json.dumps(report))
        else:
            click.echo(", ".join(f"{k}: {len(v)}" for k, v in report.items()))
        if every_s is None:
            return
        time.sleep(every_s)


@cli.group()
def db() -> None:
    """Database maintenance."""


@db.command("upgrade")
@click.pass_obj
@guard
def db_upgrade(obj: CliContext) -> None:
    """Apply Alembic migrations up to the newest revision."""
    from pipeline.orchestration.bootstrap import migrate_database

    url = migrate_database(obj.settings)
    click.echo(f"database at {url} is up to date")


@cli.command("api-token")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, type=click.Choice(["read", "submit", "admin"]),
              default=("read",),
              show_default=True, help="Repeatable; submit also allows reading and changing the token's own "
                                      "jobs, admin changing anyone's.")
@click.option("--team", default=None, help="The team the token's jobs count against (its share, caps and "
                                           "quota in BONSAI_TEAMS_FILE); default: a team of its own.")
def api_token(name: str, scopes: tuple[str, ...], team: str | None) -> None:
    """Make an API token: prints the token (shown once) and its BONSAI_API_TOKENS entry (a hash)."""
    from pipeline.app.api.auth import new_token

    for what, value in (("token name", name), ("team", team or "x")):
        if not value.replace("-", "").replace("_", "").isalnum():
            fail(f"{what} {value!r}: use letters, digits, '-' and '_'")
    token, entry = new_token(name, scopes, team)
    click.echo(f"token: {token}")
    click.echo(f"entry: {entry}")
    click.echo("add the entry to BONSAI_API_TOKENS (comma-separated); the token itself is not stored",
               err=True)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.pass_obj
@guard
def serve(obj: CliContext, host: str, port: int) -> None:
    """Run the HTTP API and the web page (embedded mode runs submitted jobs in this process)."""
    from pipeline.app.api.auth import parse_tokens

    if not parse_tokens(obj.settings.api_tokens):
        fail("no API tokens configured: set BONSAI_API_TOKENS (make an entry with `bonsai api-token NAME`)")
    import uvicorn

    from pipeline.app.api.app import create_app

    uvicorn.run(create_app(obj.settings, obj.runtime()), host=host, port=port, log_level="info")


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def workers(obj: CliContext, as_json: bool) -> None:
    """Workers: their queues, what they hold, their last heartbeat; and queues no live worker serves."""
    from pipeline.app.views import worker_rows
    from pipeline.db.session import session_scope

    if obj.settings.is_embedded:
        click.echo("embedded mode (no BONSAI_BROKER_URL): stages run in the process that runs the job; "
                   "there are no workers")
        return
    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        rows, idle_queues = worker_rows(session, obj.settings.heartbeat_timeout_s)
    if as_json:
        click.echo(json.dumps({"workers": rows, "queues_without_live_worker": idle_queues}, indent=2,
                              sort_keys=True, default=str))
        return
    if not rows:
        click.echo("no worker has ever reported: start one with `bonsai worker --queues io,cpu,gpu`")
    for row in rows:
        held = f", holds {len(row['held_task_ids'])} task(s)" if row["held_task_ids"] else ""
        cap = f"cap {row['memory_limit_mb']:,} MB" if row["memory_limit_mb"] else "no memory cap"
        click.echo(f"{row['name']:<32} {row['state']:<8} queues {','.join(row['queues'])}; {cap}; "
                   f"last heartbeat {row['heartbeat_age_s']:.0f}s ago{held}")
    for queue in idle_queues:
        click.echo(f"warning: no live worker serves queue {queue!r}; its stages wait until one does "
                   f"(`bonsai worker --queues {queue}`)", err=True)
