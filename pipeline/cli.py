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
@click.option("--home", type=click.Path(path_type=Path), envvar="BONSAI_HOME",
              help="Data folder (embedded mode).")
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


def _stage_names() -> list[Any]:
    from pipeline.states import StageName

    return list(StageName)


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
@click.option("--recipe", default="tq2_0", show_default=True, help="Named recipe (tq2_0, tq1_0, q2_0, q1_0).")
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


def _require_broker(obj: CliContext, command: str) -> None:
    if obj.settings.is_embedded:
        _fail(f"`bonsai {command}` needs a broker: set BONSAI_BROKER_URL or --broker-url "
              "(for one checkpoint without servers, use `bonsai convert`)")


def _export_settings(settings: Settings) -> None:
    """Put CLI overrides into the environment so Celery and its pool children see them."""
    import os

    values = {"BONSAI_HOME": str(settings.home), "BONSAI_DATABASE_URL": settings.resolved_database_url,
              "BONSAI_BROKER_URL": settings.broker_url,
              "BONSAI_ARTIFACT_ROOT": str(settings.resolved_artifact_root)}
    os.environ.update({key: value for key, value in values.items() if value})


@cli.command()
@click.argument("sources", nargs=-1)
@click.option("--manifest", type=click.Path(path_type=Path, dir_okay=False),
              help="YAML or JSON list of jobs.")
@click.option("--recipe", default="tq2_0", show_default=True)
@click.option("--priority", default=0, show_default=True, help="Higher runs sooner.")
@click.option("--option", "options", multiple=True, help="Recipe knob KEY=VALUE (repeatable).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@_guard
def submit(obj: CliContext, sources: tuple[str, ...], manifest: Path | None, recipe: str, priority: int,
           options: tuple[str, ...], as_json: bool) -> None:
    """Record jobs and dispatch them to workers; prints the job ids."""
    from pipeline.job_control import JobRequest, read_manifest

    _require_broker(obj, "submit")
    requests = [JobRequest(s, recipe, priority, _parse_options(options)) for s in sources]
    if manifest is not None:
        requests += read_manifest(manifest, recipe, priority)
    if not requests:
        _fail("nothing to submit: give SOURCE arguments or --manifest FILE")
    _export_settings(obj.settings)
    from workers.control import submit_jobs

    job_ids = submit_jobs(obj.runtime(), obj.settings, requests)
    click.echo(json.dumps({"job_ids": job_ids}) if as_json else "\n".join(map(str, job_ids)))


@cli.command()
@click.argument("job_id", type=int)
@click.option("--from", "from_stage", type=click.Choice([s.value for s in _stage_names()]), default=None,
              help="First stage to rerun (default: the first one not done).")
@click.option("--force", is_flag=True, help="Ignore cached results for the rerun stages.")
@click.pass_obj
@_guard
def retry(obj: CliContext, job_id: int, from_stage: str | None, force: bool) -> None:
    """New attempts for STAGE and everything after it; earlier attempts are kept."""
    from pipeline.db.session import session_scope
    from pipeline.job_control import retry_job
    from pipeline.states import StageName

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        run_ids = retry_job(session, job_id, StageName(from_stage) if from_stage else None, force)
    click.echo(f"job {job_id}: {len(run_ids)} new attempts")
    if obj.settings.is_embedded:
        from pipeline.convert import run_and_report

        sys.exit(run_and_report(rt, job_id, as_json=False))
    _export_settings(obj.settings)
    from workers.dispatch import advance

    advance(rt.sessions, obj.settings, job_id)


@cli.command()
@click.argument("job_id", type=int)
@click.pass_obj
@_guard
def cancel(obj: CliContext, job_id: int) -> None:
    """Stop a job: unfinished attempts are cancelled and running tasks revoked."""
    from pipeline.db.session import session_scope
    from pipeline.job_control import cancel_job

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        task_ids = cancel_job(session, job_id)
    if task_ids and not obj.settings.is_embedded:
        _export_settings(obj.settings)
        from workers.celery_app import app

        app.control.revoke(task_ids, terminate=True, signal="SIGTERM")
    click.echo(f"job {job_id} cancelled ({len(task_ids)} task(s) revoked)")


@cli.command()
@click.option("--queues", default="io,cpu,gpu", show_default=True, help="Comma-separated: io, cpu, gpu.")
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(1, 256))
@click.option("--hostname", default=None, help="Worker node name (default bonsai-QUEUES@host).")
@click.pass_obj
@_guard
def worker(obj: CliContext, queues: str, concurrency: int, hostname: str | None) -> None:
    """Run a Celery worker for the given queues."""
    _require_broker(obj, "worker")
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(wanted) - {"io", "cpu", "gpu"})
    if unknown or not wanted:
        _fail(f"--queues {queues!r}: unknown queue(s) {unknown}; choose from io, cpu, gpu")
    _export_settings(obj.settings)
    from workers.celery_app import app

    name = hostname or f"bonsai-{'-'.join(wanted)}@%h"
    app.worker_main(["worker", "-Q", ",".join(wanted), "-c", str(concurrency), "-O", "fair",
                     "-n", name, "--loglevel", "INFO", "--without-gossip", "--without-mingle"])


@cli.command()
@click.option("--every", "every_s", type=float, default=None, help="Repeat every N seconds until stopped.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@_guard
def reconcile(obj: CliContext, every_s: float | None, as_json: bool) -> None:
    """Re-dispatch stage runs whose message or worker was lost."""
    import time

    _require_broker(obj, "reconcile")
    _export_settings(obj.settings)
    from workers.reconcile import reconcile as reconcile_once

    rt = obj.runtime()
    while True:
        report = reconcile_once(rt, obj.settings).as_dict()
        if as_json:
            click.echo(json.dumps(report))
        else:
            click.echo(", ".join(f"{k}: {len(v)}" for k, v in report.items()))
        if every_s is None:
            return
        time.sleep(every_s)


@cli.command()
@click.option("--watch", "watch_s", type=float, default=None, help="Refresh every N seconds.")
@click.option("--status", "status", default=None, help="Only jobs in this state.")
@click.pass_obj
@_guard
def status(obj: CliContext, watch_s: float | None, status: str | None) -> None:
    """Jobs with their progress; with --watch, a live table."""
    from pipeline.reports import watch_jobs

    watch_jobs(obj.runtime(), status, watch_s)


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
@_guard
def demo_checkpoint(dest: Path, layers: int, architecture: str) -> None:
    """Write a small ternary-trained-style demo checkpoint (Llama unless --architecture) into DEST."""
    from pipeline.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(dest, n_layers=layers, architecture=architecture)
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


def _artifact_sha(session: Any, artifact: str | None, job_id: int | None) -> str:
    from pipeline.audit import job_gguf, resolve_artifact

    if artifact is not None and job_id is not None:
        _fail("give ARTIFACT or --job N, not both")
    if artifact is None and job_id is None:
        _fail("give ARTIFACT (a sha256 or a unique prefix of one) or --job N (that job's GGUF)")
    return (resolve_artifact(session, artifact) if artifact else job_gguf(session, job_id)).sha256  # type: ignore[arg-type]


@cli.command()
@click.argument("artifact", required=False)
@click.option("--job", "job_id", type=int, default=None, help="Audit this job's GGUF.")
@click.option("--no-rehash", is_flag=True, help="Check the records only; do not re-read the files.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@_guard
def audit(obj: CliContext, artifact: str | None, job_id: int | None, no_rehash: bool, as_json: bool) -> None:
    """Re-hash ARTIFACT and its whole input chain and check every provenance link; exit 1 when broken.

    Signatures are checked too when BONSAI_SIGNING_PUBLIC_KEY (or BONSAI_SIGNING_KEY) is set.
    """
    from pipeline.audit import audit_artifact
    from pipeline.db.session import session_scope
    from pipeline.signing import configured_public_key

    rt = obj.runtime()
    key = configured_public_key(obj.settings.signing_public_key, obj.settings.signing_key)
    with session_scope(rt.sessions) as session:
        sha256 = _artifact_sha(session, artifact, job_id)
        report = audit_artifact(session, rt.store, sha256, rehash=not no_rehash, public_key=key)
    if as_json:
        _echo_json(report.as_dict())
    elif report.is_ok:
        signed = (f"{report.signatures['valid']} signature(s) valid" if key is not None
                  else "signatures not checked (no public key configured)")
        checked = f"{report.rehashed_bytes:,} bytes re-hashed" if report.is_rehashed else "records only"
        click.echo(f"ok: {report.name} {sha256[:12]}: {len(report.nodes)} artifacts, {report.statements} "
                   f"statements, {checked} in {report.elapsed_s:.2f}s; {signed}")
    if not report.is_ok:
        more = len(report.problems) - 1
        click.echo(f"audit failed: {report.problems[0].message}"
                   + (f" ({more} more problem(s); --json lists them)" if more else ""), err=True)
        sys.exit(1)


@cli.command("provenance")
@click.argument("artifact", required=False)
@click.option("--job", "job_id", type=int, default=None, help="This job's GGUF.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False),
              help="Write .intoto.json files (and .dsse.json envelopes) here instead of printing JSON.")
@click.option("--chain/--no-chain", default=True, show_default=True,
              help="Include the statements of every input down to the source files.")
@click.pass_obj
@_guard
def provenance_cmd(obj: CliContext, artifact: str | None, job_id: int | None, out: Path | None,
                   chain: bool) -> None:
    """Export the in-toto provenance statements of ARTIFACT (and of its inputs)."""
    from pipeline.audit import chain_statements, export_statements
    from pipeline.db.session import session_scope

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        sha256 = _artifact_sha(session, artifact, job_id)
        items = chain_statements(session, rt.store, sha256, is_chain=chain)
    if out is None:
        _echo_json(items)
        return
    paths = export_statements(items, out)
    click.echo(f"{len(items)} statement(s) written to {out} ({len(paths)} files)")


@cli.command()
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Private key file (default: BONSAI_SIGNING_KEY, else <home>/keys/signing.pem).")
@click.pass_obj
@_guard
def keygen(obj: CliContext, out: Path | None) -> None:
    """Make an Ed25519 key pair for signing provenance statements (never overwrites a key)."""
    from pipeline.signing import generate_key, key_id, load_public_key

    private_path, public_path = generate_key(out or obj.settings.signing_key
                                             or obj.settings.home / "keys" / "signing.pem")
    click.echo(f"private key {private_path} (mode 0600), public key {public_path}")
    click.echo(f"key id {key_id(load_public_key(public_path))}")
    click.echo(f"sign with BONSAI_SIGNING_KEY={private_path.resolve()}; "
               f"verify elsewhere with BONSAI_SIGNING_PUBLIC_KEY={public_path.resolve()}")


@cli.command()
@click.option("--job", "job_id", type=int, default=None, help="Only this job's statements (default: all).")
@click.pass_obj
@_guard
def sign(obj: CliContext, job_id: int | None) -> None:
    """Sign stored provenance statements not yet signed by BONSAI_SIGNING_KEY (DSSE envelopes)."""
    from pipeline.db.session import session_scope
    from pipeline.signing import load_private_key, sign_pending

    if obj.settings.signing_key is None:
        _fail("set BONSAI_SIGNING_KEY to a private key file (make one with `bonsai keygen`)")
    key = load_private_key(obj.settings.signing_key)  # type: ignore[arg-type]
    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        count = sign_pending(session, rt.store, key, job_id)
    click.echo(f"{count} statement(s) signed")


@cli.command("api-token")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, type=click.Choice(["read", "submit"]), default=("read",),
              show_default=True, help="Repeatable; submit also allows reading.")
def api_token(name: str, scopes: tuple[str, ...]) -> None:
    """Make an API token: prints the token (shown once) and its BONSAI_API_TOKENS entry (a hash)."""
    from pipeline.api.auth import new_token

    if not name.replace("-", "").replace("_", "").isalnum():
        _fail(f"token name {name!r}: use letters, digits, '-' and '_'")
    token, entry = new_token(name, scopes)
    click.echo(f"token: {token}")
    click.echo(f"entry: {entry}")
    click.echo("add the entry to BONSAI_API_TOKENS (comma-separated); the token itself is not stored",
               err=True)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.pass_obj
@_guard
def serve(obj: CliContext, host: str, port: int) -> None:
    """Run the HTTP API and the web page (embedded mode runs submitted jobs in this process)."""
    from pipeline.api.auth import parse_tokens

    if not parse_tokens(obj.settings.api_tokens):
        _fail("no API tokens configured: set BONSAI_API_TOKENS (make an entry with `bonsai api-token NAME`)")
    if not obj.settings.is_embedded:
        _export_settings(obj.settings)
    import uvicorn

    from pipeline.api.app import create_app

    uvicorn.run(create_app(obj.settings, obj.runtime()), host=host, port=port, log_level="info")


def main() -> None:
    cli(prog_name="bonsai")
