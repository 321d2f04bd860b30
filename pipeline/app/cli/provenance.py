"""Commands about provenance: audit, provenance export, key generation and signing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pipeline.app.cli.main import (
    CliContext,
    cli,
    cli_actor,
    echo_json,
    fail,
    guard,
)


def _artifact_sha(session: Any, artifact: str | None, job_id: int | None) -> str:
    from pipeline.provenance.audit import job_gguf, resolve_artifact

    if artifact is not None and job_id is not None:
        fail("give ARTIFACT or --job N, not both")
    if artifact is None and job_id is None:
        fail("give ARTIFACT (a sha256 or a unique prefix of one) or --job N (that job's GGUF)")
    return (resolve_artifact(session, artifact) if artifact else job_gguf(session, job_id)).sha256  # type: ignore[arg-type]


@cli.command()
@click.argument("artifact", required=False)
@click.option("--job", "job_id", type=int, default=None, help="Audit this job's GGUF.")
@click.option("--no-rehash", is_flag=True, help="Check the records only; do not re-read the files.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def audit(obj: CliContext, artifact: str | None, job_id: int | None, no_rehash: bool, as_json: bool) -> None:
    """Re-hash ARTIFACT and its whole input chain and check every provenance link; exit 1 when broken.

    Signatures are checked too when BONSAI_SIGNING_PUBLIC_KEY (or BONSAI_SIGNING_KEY) is set.
    """
    from pipeline.db.session import session_scope
    from pipeline.provenance.audit import audit_artifact
    from pipeline.provenance.signing import configured_public_key

    rt = obj.runtime()
    key = configured_public_key(obj.settings.signing_public_key, obj.settings.signing_key)
    with session_scope(rt.sessions) as session:
        sha256 = _artifact_sha(session, artifact, job_id)
        report = audit_artifact(session, rt.store, sha256, rehash=not no_rehash, public_key=key)
    if as_json:
        echo_json(report.as_dict())
    elif report.is_ok:
        signed = (f"{report.signatures['valid']} signature(s) valid" if key is not None
                  else "signatures not checked (no public key configured)")
        checked = f"{report.rehashed_bytes:,} bytes re-hashed" if report.is_rehashed else "records only"
        if report.not_retained:
            checked += f" ({report.not_retained} artifact(s): bytes not retained, removed by `bonsai gc`)"
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
@guard
def provenance_cmd(obj: CliContext, artifact: str | None, job_id: int | None, out: Path | None,
                   chain: bool) -> None:
    """Export the in-toto provenance statements of ARTIFACT (and of its inputs)."""
    from pipeline.db.session import session_scope
    from pipeline.provenance.export import chain_statements, export_statements

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        sha256 = _artifact_sha(session, artifact, job_id)
        items = chain_statements(session, rt.store, sha256, is_chain=chain)
    if out is None:
        echo_json(items)
        return
    paths = export_statements(items, out)
    click.echo(f"{len(items)} statement(s) written to {out} ({len(paths)} files)")


@cli.command()
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Private key file (default: BONSAI_SIGNING_KEY, else <home>/keys/signing.pem).")
@click.pass_obj
@guard
def keygen(obj: CliContext, out: Path | None) -> None:
    """Make an Ed25519 key pair for signing provenance statements (never overwrites a key)."""
    from pipeline.provenance.signing import generate_key, key_id, load_public_key

    private_path, public_path = generate_key(out or obj.settings.signing_key
                                             or obj.settings.home / "keys" / "signing.pem")
    click.echo(f"private key {private_path} (mode 0600), public key {public_path}")
    click.echo(f"key id {key_id(load_public_key(public_path))}")
    click.echo(f"sign with BONSAI_SIGNING_KEY={private_path.resolve()}; "
               f"verify elsewhere with BONSAI_SIGNING_PUBLIC_KEY={public_path.resolve()}")


@cli.command()
@click.option("--job", "job_id", type=int, default=None, help="Only this job's statements (default: all).")
@click.pass_obj
@guard
def sign(obj: CliContext, job_id: int | None) -> None:
    """Sign stored provenance statements not yet signed by BONSAI_SIGNING_KEY (DSSE envelopes)."""
    from pipeline.db.session import session_scope
    from pipeline.provenance.signing import load_private_key, sign_pending

    if obj.settings.signing_key is None:
        fail("set BONSAI_SIGNING_KEY to a private key file (make one with `bonsai keygen`)")
    key = load_private_key(obj.settings.signing_key)  # type: ignore[arg-type]
    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        count = sign_pending(session, rt.store, key, job_id)
    click.echo(f"{count} statement(s) signed")


@cli.command()
@click.argument("job_id", type=int)
@click.option("--to", "dest", required=True, help="A new folder, or s3://bucket/prefix.")
@click.option("--split-max-size", default=None,
              help="Split the GGUF into llama.cpp split files of at most this size (2G, 500M).")
@click.option("--force", is_flag=True, help="Publish even though validation failed (the card says so).")
@click.pass_obj
@guard
def publish(obj: CliContext, job_id: int, dest: str, split_max_size: str | None, force: bool) -> None:
    """A shareable bundle of JOB: GGUF (split if asked), model card, SHA256SUMS, provenance."""
    from pipeline.app.publishing import publish_job
    from pipeline.db.session import session_scope
    from pipeline.publish import parse_size

    max_bytes = parse_size(split_max_size) if split_max_size else None
    rt = obj.runtime()
    client = None
    if dest.startswith("s3://"):
        from pipeline.artifacts.s3 import make_s3_client

        client = make_s3_client(obj.settings.s3_endpoint_url)
    with session_scope(rt.sessions) as session:
        bundle, where = publish_job(session, rt.store, job_id, dest, split_max_bytes=max_bytes,
                                    is_forced=force, s3_client=client, actor=cli_actor())
    click.echo(f"job {job_id} published to {where}: {', '.join(bundle.files)}, SHA256SUMS")


@cli.command()
@click.option("--job", "job_id", type=int, default=None, help="Only this job's actions.")
@click.option("--actor", default=None, help="Only this actor's actions (cli:USER, api:TOKEN, ...).")
@click.option("--action", default=None,
              help="Only this kind: submit, cancel, retry, publish, pin, unpin, gc.")
@click.option("--since", default=None,
              help="Only actions at or after this time (ISO 8601; UTC without a zone).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def history(obj: CliContext, job_id: int | None, actor: str | None, action: str | None, since: str | None,
            as_json: bool) -> None:
    """Who did what, when, to which job or artifact, and how it ended: submit, cancel, retry, publish,
    pin, unpin, gc. Rows are written once and never rewritten."""
    from pipeline.app.terminal import printable
    from pipeline.app.views import action_rows, history_since
    from pipeline.db import actions
    from pipeline.db.session import session_scope

    moment = history_since(since)
    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        found = actions.history(session, job_id=job_id, actor=actor, action=action, since=moment)
        rows = action_rows(found)
    if as_json:
        echo_json(rows)
        return
    for row in rows:
        detail = " ".join(f"{key}={value}" for key, value in row["detail"].items())
        line = f"{row['at']}  {row['actor']}  {row['action']}  {row['target']}  {row['outcome']}"
        click.echo(printable(line + (f"  {detail}" if detail else "")))


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def teams(obj: CliContext, as_json: bool) -> None:
    """Per team: attempts running and waiting, unfinished jobs, share of the running slots (and the
    weighted share it is owed), decayed usage, caps (BONSAI_TEAMS_FILE) and the storage quota used."""
    from pipeline.app.terminal import printable
    from pipeline.app.views import team_rows
    from pipeline.db.session import session_scope

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        rows = team_rows(session, rt.teams)
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no team has work, stored bytes or a policy yet")
    for row in rows:
        caps = ", ".join(f"{key} {row[key]}" for key in ("max_running", "max_pending", "max_priority")
                         if row[key] is not None) or "no caps"
        quota = (f", quota {row['quota_used']:.0%} of {row['storage_quota_bytes'] / 1024**3:.1f} GB"
                 if row["quota_used"] is not None else "")
        click.echo(printable(
            f"{row['team']}: running {row['running']}, waiting {row['waiting']}, {row['pending_jobs']} "
            f"unfinished job(s), share {row['share']:.0%} (owed {row['weighted_share']:.0%} at weight "
            f"{row['weight']:g}), usage {row['usage_s']:.0f} s, stored {row['stored_bytes'] / 1024**2:.1f} MB"
            f"{quota}; {caps}"))
