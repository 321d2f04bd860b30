"""The demo conversion's whole chain through the real CLI on PostgreSQL: audit, export, sign, tamper.

One `bonsai convert` (about 10 s) serves every test here, run with BONSAI_HF_TOKEN set so
the same job also proves that the token reaches no row, statement, log or stored file.
Tests run in file order; the tamper test puts the original bytes back when it ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.lossy_demo import LOSSY_ARGS

pytestmark = [pytest.mark.services, pytest.mark.llama, pytest.mark.slow]

HF_TOKEN = "hf_auditTEST" + uuid.uuid4().hex  # unique: any hit is this test's token and nothing else
_PG_URL = os.environ.get("BONSAI_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@dataclass
class Demo:
    home: Path
    db_url: str
    convert: subprocess.CompletedProcess[str]
    detail: dict[str, Any] | None = None

    def bonsai(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, "BONSAI_HOME": str(self.home), "BONSAI_DATABASE_URL": self.db_url, **env}
        for name in ("BONSAI_BROKER_URL", "BONSAI_SIGNING_KEY", "BONSAI_SIGNING_PUBLIC_KEY"):
            if name not in env:
                full_env.pop(name, None)
        return subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def show(self, job_id: int = 1) -> dict[str, Any]:
        result = self.bonsai("show", str(job_id), "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A PostgreSQL database for this module (one conversion shared by its tests), dropped after."""
    admin_url = _PG_URL.replace("postgresql+psycopg://", "postgresql://")
    name = f"bonsai_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(admin_url, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL is required under CI and could not be reached: {exc}")
        pytest.skip(f"PostgreSQL not reachable ({exc}); run `make services` or `make test`")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{_PG_URL.rpartition('/')[0]}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def demo(database: str, demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Demo:
    home = tmp_path_factory.mktemp("audit_home")
    probe = Demo(home, database, subprocess.CompletedProcess([], 0))
    assert probe.bonsai("db", "upgrade").returncode == 0
    # The lossy route: calibrate's reference is one of the statements.
    convert = probe.bonsai("-v", "convert", str(demo_checkpoint), *LOSSY_ARGS, BONSAI_HF_TOKEN=HF_TOKEN)
    assert convert.returncode == 0, convert.stdout + convert.stderr
    return Demo(home, database, convert, probe.show())


def test_hf_token_reaches_no_row_statement_log_or_file(demo: Demo) -> None:
    assert "INFO" in demo.convert.stderr, "the conversion ran with logging on"
    assert HF_TOKEN not in demo.convert.stdout + demo.convert.stderr

    with psycopg.connect(demo.db_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        assert {"jobs", "stage_runs", "artifacts", "run_artifacts", "provenance"} <= set(tables)
        for table in tables:
            rows = conn.execute(f'SELECT row_to_json(t)::text FROM "{table}" t').fetchall()
            leaked = [row[0][:200] for row in rows if HF_TOKEN in row[0]]
            assert not leaked, f"token found in table {table}: {leaked}"

    token_bytes = HF_TOKEN.encode()
    files = [p for p in demo.home.rglob("*") if p.is_file()]
    assert len(files) > 10, "the store holds the job's files"
    assert [p for p in files if token_bytes in p.read_bytes()] == []


def test_clean_chain_verifies_from_the_gguf_down_to_the_downloads(demo: Demo) -> None:
    assert demo.detail is not None
    gguf = demo.detail["gguf"]

    text = demo.bonsai("audit", "--job", "1")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"ok: package/model.gguf {gguf['sha256'][:12]}")

    result = demo.bonsai("audit", gguf["sha256"][:10], "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["problems"] == [] and report["first_problem"] is None
    names = {node["name"] for node in report["nodes"]}
    assert {
        "package/model.gguf",
        "decompose/ternary/part-00001.safetensors",
        "inspect/model_card.json",
        "checksum/manifest.json",
        "download/config.json",
        "download/model.safetensors",
    } <= names
    sources = [n for n in report["nodes"] if n["name"].startswith("download/")]
    assert sources and all(n["inputs"] == [] for n in sources)
    assert report["rehashed_bytes"] >= gguf["size_bytes"]


def test_statements_export_as_intoto_files(demo: Demo, tmp_path: Path) -> None:
    result = demo.bonsai("provenance", "--job", "1", "--out", str(tmp_path / "prov"))
    assert result.returncode == 0, result.stderr
    files = sorted((tmp_path / "prov").glob("*.intoto.json"))
    gguf_file = next(p for p in files if p.name.startswith("package.model.gguf."))
    statement = json.loads(gguf_file.read_text())
    assert statement["subject"][0]["name"] == "model.gguf"
    assert statement["predicate"]["runDetails"]["metadata"]["invocationId"].startswith("job/1/stage/package/")
    assert any(p.name.startswith("download.config.json.") for p in files)


def test_signed_statements_verify_in_audit(demo: Demo, tmp_path: Path) -> None:
    if os.environ.get("CI") != "true":
        pytest.importorskip("cryptography", reason="pip install '.[signing]' for signing")
    key = tmp_path / "signing.pem"
    assert demo.bonsai("keygen", "--out", str(key)).returncode == 0
    public = {"BONSAI_SIGNING_PUBLIC_KEY": f"{key}.pub"}

    signed = demo.bonsai("sign", "--job", "1", BONSAI_SIGNING_KEY=str(key))
    # One statement per output: calibrate's reference is the thirteenth.
    assert signed.returncode == 0 and signed.stdout.startswith("13 statement(s) signed"), signed.stdout

    result = demo.bonsai("audit", "--job", "1", "--json", **public)
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout)["signatures"]["valid"] == 11  # the GGUF's chain (validate is downstream)


def test_tampered_source_file_fails_the_gguf_audit_naming_it(demo: Demo) -> None:
    assert demo.detail is not None
    config = next(o for o in demo.detail["stages"][0]["outputs"] if o["name"] == "config.json")
    path = Path(config["path"])
    original = path.read_bytes()
    os.chmod(path, 0o644)
    try:
        path.write_bytes(original.replace(b"llama", b"llamb", 1))
        result = demo.bonsai("audit", "--job", "1")
    finally:
        path.write_bytes(original)
        os.chmod(path, 0o444)

    assert result.returncode == 1
    actual = hashlib.sha256(original.replace(b"llama", b"llamb", 1)).hexdigest()
    assert result.stderr.startswith(
        f"audit failed: tampered: download/config.json sha256 {config['sha256']} recorded, {actual} on disk"
    ), result.stderr
