"""`bonsai convert` end to end, through the real CLI, on the real PostgreSQL server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.services, pytest.mark.llama, pytest.mark.slow]

STAGES = ["download", "checksum", "inspect", "calibrate", "decompose", "package", "validate"]


def _bonsai(home: Path, db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BONSAI_HOME": str(home), "BONSAI_DATABASE_URL": db_url}
    env.pop("BONSAI_BROKER_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], env=env, capture_output=True, text=True, timeout=600
    )


def _show(home: Path, db_url: str, job_id: int) -> dict[str, Any]:
    result = _bonsai(home, db_url, "show", str(job_id), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def migrated(pg_url: str, tmp_path: Path) -> tuple[Path, str]:
    home = tmp_path / "home"
    result = _bonsai(home, pg_url, "db", "upgrade")
    assert result.returncode == 0, result.stderr
    return home, pg_url


def test_convert_demo_checkpoint_on_postgres(migrated: tuple[Path, str], demo_checkpoint: Path) -> None:
    home, db_url = migrated
    result = _bonsai(home, db_url, "convert", str(demo_checkpoint))
    assert result.returncode == 0, result.stdout + result.stderr
    detail = _show(home, db_url, 1)

    assert detail["status"] == "succeeded"
    assert [run["stage"] for run in detail["stages"]] == STAGES
    # Exact by default: the BF16 embedding and head stay BF16, so the source never runs.
    assert {run["stage"]: run["status"] for run in detail["stages"]} == {
        stage: "not-needed" if stage == "calibrate" else "succeeded" for stage in STAGES}
    for run in detail["stages"]:
        for artifact in run["outputs"]:
            data = Path(artifact["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == artifact["sha256"], artifact["name"]
            assert len(data) == artifact["size_bytes"]

    gguf_path = Path(detail["gguf"]["path"])
    from gguf import GGMLQuantizationType, GGUFReader

    types = {t.name: GGMLQuantizationType(t.tensor_type) for t in GGUFReader(gguf_path).tensors}
    assert types["blk.0.attn_q.weight"] is GGMLQuantizationType.TQ2_0
    assert types["blk.1.ffn_down.weight"] is GGMLQuantizationType.TQ2_0
    assert types["token_embd.weight"] is types["output.weight"] is GGMLQuantizationType.BF16

    decompose = next(r["metrics"] for r in detail["stages"] if r["stage"] == "decompose")
    assert decompose["rel_error"] < 1e-3, "demo weights are exactly ternary: conversion must be lossless"
    assert decompose["exact"] is True

    validation = detail["validation"]
    assert validation["checks"]["loads"] == "pass"
    assert isinstance(validation["text"], str)
    assert validation["verdict"] in ("pass", "warn")

    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=64, verbose=False)
    assert llm.n_vocab() == json.loads((demo_checkpoint / "config.json").read_text())["vocab_size"]


def test_corrupted_file_stops_job_at_checksum(
    migrated: tuple[Path, str], demo_checkpoint: Path, tmp_path: Path
) -> None:
    home, db_url = migrated
    source = tmp_path / "corrupted"
    shutil.copytree(demo_checkpoint, source)
    config = source / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))

    result = _bonsai(home, db_url, "convert", str(source))
    assert result.returncode == 1
    detail = _show(home, db_url, 1)

    assert detail["status"] == "failed"
    assert [run["stage"] for run in detail["stages"]] == ["download", "checksum"]
    checksum = detail["stages"][1]
    assert checksum["status"] == "failed"
    assert checksum["error_kind"] == "permanent"
    assert "config.json" in checksum["error_message"]
    actual = hashlib.sha256(config.read_bytes()).hexdigest()
    assert actual in checksum["error_message"]
    assert "config.json" in detail["error_message"]


def test_missing_source_is_a_clear_error(migrated: tuple[Path, str], tmp_path: Path) -> None:
    home, db_url = migrated
    result = _bonsai(home, db_url, "convert", str(tmp_path / "no-such-folder"))
    # Checked before a job exists: one clear line, exit 2, nothing recorded.
    assert result.returncode == 2
    assert "no-such-folder" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    jobs = _bonsai(home, db_url, "jobs", "--json")
    assert json.loads(jobs.stdout) == []
