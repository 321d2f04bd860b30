"""`audit_artifact` on a real two-stage chain (download -> checksum) in PostgreSQL, then broken on purpose.

The chain comes from the real stages: a job on a folder without weights runs download and
checksum, then stops at inspect. Each test breaks one link (a file's bytes, a file, a
statement, a run's input links, a signature) and checks the audit names it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import delete, select

from pipeline.core.errors import InputError
from pipeline.core.settings import Settings
from pipeline.db import repo
from pipeline.db.models import Provenance, RunArtifact
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime, migrate_database
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.runtime import Runtime
from pipeline.provenance.audit import audit_artifact, job_gguf, resolve_artifact
from pipeline.provenance.export import chain_statements, export_statements

pytestmark = pytest.mark.services


@dataclass(frozen=True)
class Chain:
    rt: Runtime
    job_id: int
    manifest: str  # sha256 of checksum/manifest.json
    config: str  # sha256 of download/config.json
    notes: str  # sha256 of download/tokenizer_config.json


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def chain(pg_url: str, tmp_path: Path) -> Chain:
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    (source / "tokenizer_config.json").write_text("made for the audit tests\n")
    settings = Settings(home=tmp_path / "home", database_url=pg_url)
    migrate_database(settings)
    rt = build_runtime(settings)
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), "tq2_0").id
    run_job(rt, job_id)  # stops at inspect (no weights): download and checksum succeeded
    with session_scope(rt.sessions) as session:
        manifest = session.scalar(
            select(RunArtifact.artifact_sha256).where(RunArtifact.name == "manifest.json")
        )
    assert manifest is not None
    return Chain(
        rt,
        job_id,
        manifest,
        _sha((source / "config.json").read_bytes()),
        _sha((source / "tokenizer_config.json").read_bytes()),
    )


def _audit(chain: Chain, **options: object):  # type: ignore[no-untyped-def]
    with session_scope(chain.rt.sessions) as session:
        return audit_artifact(session, chain.rt.store, chain.manifest, **options)  # type: ignore[arg-type]


def _edit_statement(chain: Chain, sha256: str, edit) -> None:  # type: ignore[no-untyped-def]
    with session_scope(chain.rt.sessions) as session:
        row = session.scalars(select(Provenance).where(Provenance.artifact_sha256 == sha256)).one()
        statement = copy.deepcopy(row.statement)
        edit(statement)
        row.statement = statement  # a new object, so the JSON column is written


def test_clean_chain_verifies_down_to_the_source_files(chain: Chain) -> None:
    report = _audit(chain)

    assert report.is_ok, report.problems
    names = [node["name"] for node in report.nodes]
    assert names == ["checksum/manifest.json", "download/config.json", "download/tokenizer_config.json"]
    assert report.statements == 3
    sizes = sum(chain.rt.store.path(n["sha256"]).stat().st_size for n in report.nodes)
    assert report.rehashed_bytes == sizes
    download_nodes = report.nodes[1:]
    assert all(node["inputs"] == [] for node in download_nodes), "download outputs have no inputs"
    assert report.nodes[0]["statements"][0]["job_id"] == chain.job_id


def test_tampered_source_file_is_named_with_both_digests(chain: Chain) -> None:
    path = chain.rt.store.path(chain.config)
    os.chmod(path, 0o644)
    path.write_bytes(b'{"model_type": "mistral"}\n')

    report = _audit(chain)

    assert not report.is_ok
    actual = _sha(b'{"model_type": "mistral"}\n')
    assert report.problems[0].message == (
        f"tampered: download/config.json sha256 {chain.config} recorded, {actual} on disk"
    )
    assert [p.kind for p in report.problems] == ["tampered"]
    # Records-only mode does not read the bytes, so it cannot see this.
    assert _audit(chain, rehash=False).is_ok


def test_file_missing_from_the_store_is_named(chain: Chain) -> None:
    chain.rt.store.path(chain.notes).unlink()
    report = _audit(chain)
    assert report.problems[0].kind == "missing"
    expected = f"missing: download/tokenizer_config.json sha256 {chain.notes} recorded"
    assert report.problems[0].message.startswith(expected)


def test_statement_inputs_must_equal_the_runs_recorded_inputs(chain: Chain) -> None:
    forged = "0" * 64

    def swap(statement: dict) -> None:  # type: ignore[type-arg]
        for dep in statement["predicate"]["buildDefinition"]["resolvedDependencies"]:
            if dep["name"] == "download/tokenizer_config.json":
                dep["digest"]["sha256"] = forged

    _edit_statement(chain, chain.manifest, swap)
    report = _audit(chain)

    first = report.problems[0]
    assert (first.kind, first.name) == ("inputs-mismatch", "checksum/manifest.json")
    name = "download/tokenizer_config.json"
    expected = f"{name} is sha256 {forged} in the statement, {chain.notes} in the run's"
    assert expected in first.message
    # The walk follows the statement's claim, and the claimed digest has no artifact at all.
    assert [p.kind for p in report.problems] == ["inputs-mismatch", "unrecorded"]


def test_input_link_missing_from_the_statement_is_named(chain: Chain) -> None:
    _edit_statement(
        chain, chain.manifest, lambda s: s["predicate"]["buildDefinition"]["resolvedDependencies"].pop()
    )
    report = _audit(chain)
    assert report.problems[0].kind == "inputs-mismatch"
    assert "recorded input download/tokenizer_config.json" in report.problems[0].message
    assert "the statement omits it" in report.problems[0].message


def test_statement_about_other_bytes_and_missing_statement(chain: Chain) -> None:
    _edit_statement(chain, chain.manifest, lambda s: s["subject"][0]["digest"].update(sha256="f" * 64))
    with session_scope(chain.rt.sessions) as session:
        session.execute(delete(Provenance).where(Provenance.artifact_sha256 == chain.notes))

    kinds = [(p.kind, p.name) for p in _audit(chain).problems]

    assert kinds == [("subject-mismatch", "checksum/manifest.json"),
                     ("no-provenance", "download/tokenizer_config.json")]


def test_signed_chain_verifies_and_edited_statement_is_caught(chain: Chain, tmp_path: Path) -> None:
    if os.environ.get("CI") != "true":
        pytest.importorskip("cryptography", reason="pip install '.[signing]' for signing")
    from pipeline.provenance.signing import generate_key, load_private_key, load_public_key, sign_pending

    private_path, public_path = generate_key(tmp_path / "k.pem")
    public = load_public_key(public_path)
    assert [p.kind for p in _audit(chain, public_key=public).problems] == ["unsigned"] * 3

    with session_scope(chain.rt.sessions) as session:
        assert sign_pending(session, chain.rt.store, load_private_key(private_path), chain.job_id) == 3
        assert sign_pending(session, chain.rt.store, load_private_key(private_path), chain.job_id) == 0
    report = _audit(chain, public_key=public)
    assert report.is_ok and report.signatures == {"valid": 3, "unsigned": 0, "bad": 0}

    _edit_statement(
        chain,
        chain.manifest,
        lambda s: s["predicate"]["buildDefinition"]["externalParameters"].update(recipe="tq1_0"),
    )
    first = _audit(chain, public_key=public).problems[0]
    assert first.kind == "bad-signature"
    assert "differs from the signed one" in first.message

    _, other = generate_key(tmp_path / "other.pem")
    report = _audit(chain, public_key=load_public_key(other))
    assert report.problems[0].kind == "unsigned" and "signed only by other keys" in report.problems[0].message


def test_artifact_references_and_statement_export(chain: Chain, tmp_path: Path) -> None:
    with session_scope(chain.rt.sessions) as session:
        assert resolve_artifact(session, chain.manifest[:8].upper()).sha256 == chain.manifest
        assert resolve_artifact(session, f"sha256:{chain.manifest}").sha256 == chain.manifest
        with pytest.raises(InputError, match="at least 6 hex"):
            resolve_artifact(session, "abc")
        with pytest.raises(InputError, match="no artifact has a sha256 starting with 000000"):
            resolve_artifact(session, "000000")
        with pytest.raises(InputError, match="no packaged GGUF"):
            job_gguf(session, chain.job_id)
        items = chain_statements(session, chain.rt.store, chain.manifest)

    written = export_statements(items, tmp_path / "export")

    assert sorted(p.name for p in written) == sorted(
        [
            f"checksum.manifest.json.{chain.manifest[:12]}.run2.intoto.json",
            f"download.config.json.{chain.config[:12]}.run1.intoto.json",
            f"download.tokenizer_config.json.{chain.notes[:12]}.run1.intoto.json",
        ]
    )
    exported = json.loads(written[0].read_text())
    assert exported["_type"] == "https://in-toto.io/Statement/v1"
    assert exported["subject"][0]["digest"]["sha256"] in {chain.manifest, chain.config, chain.notes}
