"""Export provenance: every stored statement about an artifact (and its input chain) as in-toto files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.artifacts.store import ArtifactStore
from pipeline.core.files import write_json
from pipeline.db.models import Provenance
from pipeline.provenance.audit import audit_artifact, statement_name

__all__ = ["chain_statements", "export_statements"]


def chain_statements(
    session: Session, store: ArtifactStore, sha256: str, *, is_chain: bool = True, public_key: Any = None
) -> list[dict[str, Any]]:
    """Every stored statement about `sha256` (and, with `is_chain`, about each input down the chain).

    Each item: {"name", "sha256", "stage_run_id", "statement", "envelopes"}; envelopes are
    the stored DSSE envelopes of that statement (empty when unsigned).
    """
    from pipeline.provenance.signing import envelopes_for

    if is_chain:
        report = audit_artifact(session, store, sha256, rehash=False, public_key=public_key)
        wanted = [(node["name"], node["sha256"]) for node in report.nodes]
    else:
        wanted = [(sha256[:12], sha256)]
    items = []
    for name, digest in wanted:
        for row in session.scalars(
            select(Provenance).where(Provenance.artifact_sha256 == digest).order_by(Provenance.id)
        ):
            items.append(
                {
                    "name": statement_name(row.statement) or name,
                    "sha256": digest,
                    "stage_run_id": row.stage_run_id,
                    "statement": row.statement,
                    "envelopes": [e.envelope for e in envelopes_for(session, store, row)],
                }
            )
    return items


def export_statements(items: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write each item as `<stage>.<name>.<sha12>.run<N>.intoto.json` (+ `.dsse.json` per envelope).

    Returns the paths written. Names are made from the statement, never from user input
    beyond it; slashes in artifact names become underscores.
    """
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for item in items:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in item["name"].replace("/", "."))
        stem = f"{safe}.{item['sha256'][:12]}.run{item['stage_run_id']}"
        path = folder / f"{stem}.intoto.json"
        write_json(path, item["statement"], indent=2, sort_keys=True, overwrite=True)
        written.append(path)
        for index, envelope in enumerate(item["envelopes"], 1):
            signed = folder / f"{stem}.{index}.dsse.json"
            write_json(signed, envelope, indent=2, sort_keys=True, overwrite=True)
            written.append(signed)
    return written
