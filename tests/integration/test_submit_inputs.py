"""`bonsai submit` on a real broker: the checked recipe is recorded and --target's warnings are printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.app.cli import cli

pytestmark = pytest.mark.services


def test_submit_records_the_checked_inputs_and_prints_target_warnings(
    broker_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    base = ["--db-url", f"sqlite:///{tmp_path / 'jobs.db'}", "--broker-url", broker_url]
    (tmp_path / "ckpt").mkdir()
    manifest = tmp_path / "jobs.json"
    manifest.write_text(json.dumps([{"source": str(tmp_path / "ckpt"), "recipe": "Q1_0"}]))
    runner = CliRunner()
    result = runner.invoke(cli, [*base, "submit", str(tmp_path / "ckpt"), "--target", "cuda",
                                 "--recipe", "TQ2_0", "--option", "embed_type=bf16",
                                 "--manifest", str(manifest), "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: job 1: TQ2_0 has no kernel on cuda" in result.stderr
    assert "job 2" not in result.stderr  # Q1_0 runs fast on CUDA
    assert json.loads(result.stdout) == {"job_ids": [1, 2]}
    jobs = json.loads(runner.invoke(cli, [*base, "jobs", "--json"]).stdout)
    assert [(j["recipe"], j["params"]) for j in jobs] == [
        ("tq2_0", {"embed_type": "BF16", "target": "cuda"}),
        ("q1_0", {"embed_type": "BF16", "target": "cuda"}),
    ]
    assert jobs[0]["warnings"] and jobs[1]["warnings"] == []
