"""Commands about the store's bytes: gc, pin, unpin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from pipeline.app.cli.main import CliContext, cli, cli_actor, echo_json, guard


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 10**8 else f"{n_bytes / 1e6:.1f} MB"


@cli.command()
@click.option("--older-than", default=None, metavar="AGE",
              help="Only bytes no run has written or read for this long: 90s, 45m, 12h, 7d, 2w.")
@click.option("--keep-published", is_flag=True, help="Keep the GGUFs of published jobs.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
@guard
def gc(obj: CliContext, older_than: str | None, keep_published: bool, dry_run: bool, as_json: bool) -> None:
    """Remove stored bytes that no unfinished job can read and no pin holds.

    Rows, digests and provenance statements stay (`bonsai audit` then says "bytes not retained").
    A failed job keeps its bytes for `bonsai retry`: cancel it to let them go. Safe beside running jobs.
    """
    from pipeline.db.session import session_scope
    from pipeline.orchestration.store_gc import GcRules, collect_garbage

    rules = GcRules.asked(older_than, keep_published, dry_run)
    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        report = collect_garbage(session, rt.store, rules, cli_actor())
    if as_json:
        echo_json(report.as_dict())
        return
    verb = "would remove" if dry_run else "removed"
    kept = ", ".join(f"{count} {reason}" for reason, count in report.kept.items() if count)
    click.echo(f"{verb} {len(report.removed)} artifact(s), {_size(report.removed_bytes)}"
               + (f"; kept: {kept}" if kept else ""))


def _on_artifact(obj: CliContext, ref: str, change: Callable[[Any, Any], str]) -> None:
    """Resolve ARTIFACT (a sha256 or a unique prefix), apply ``change(session, artifact)`` in one
    transaction, and print what it says."""
    from pipeline.db.session import session_scope
    from pipeline.provenance.audit import resolve_artifact

    rt = obj.runtime()
    with session_scope(rt.sessions) as session:
        said = change(session, resolve_artifact(session, ref))
    click.echo(said)


@cli.command()
@click.argument("artifact")
@click.pass_obj
@guard
def pin(obj: CliContext, artifact: str) -> None:
    """Keep ARTIFACT's bytes (a sha256 or a unique prefix) whatever `bonsai gc` is told."""
    from pipeline.db import retention

    def change(session: Any, item: Any) -> str:
        is_new = retention.pin(session, item, retention.PIN, cli_actor())
        return f"pinned {item.sha256}" + ("" if is_new else " (already pinned)")

    _on_artifact(obj, artifact, change)


@cli.command()
@click.argument("artifact")
@click.pass_obj
@guard
def unpin(obj: CliContext, artifact: str) -> None:
    """Let `bonsai gc` take ARTIFACT's bytes again (when nothing else holds them)."""
    from pipeline.db import retention

    def change(session: Any, item: Any) -> str:
        dropped = retention.unpin(session, item, cli_actor())
        return f"unpinned {item.sha256}" if dropped else f"{item.sha256} was not pinned"

    _on_artifact(obj, artifact, change)
