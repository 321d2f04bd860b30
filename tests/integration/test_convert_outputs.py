"""What a new user meets with `bonsai convert` in the embedded default (SQLite home, no servers):
a named GGUF, folders made for --out, a failed validation that still says where the file is,
`bonsai export`, typos refused before any job row, and --target's recipe and warnings."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pipeline.app.cli import cli
from tests.support.lossy_demo import LOSSY_ARGS

pytestmark = [pytest.mark.llama, pytest.mark.slow]

# An agreement bar no conversion clears (test_publish uses the same): validation fails.
# An agreement bar no lossy conversion clears (an exact one is not scored: the lossy route).
FAILING = ("--option", "agreement_pass_top1=1.0", "--option", "agreement_fail_top1=0.999", *LOSSY_ARGS)


@pytest.fixture
def workspace(tmp_path: Path, demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A current folder holding the demo as ./tiny-llama, the default home ./.bonsai, no output dir set."""
    monkeypatch.chdir(tmp_path)
    for name in ("BONSAI_HOME", "BONSAI_DATABASE_URL", "BONSAI_BROKER_URL", "BONSAI_ARTIFACT_ROOT",
                 "BONSAI_OUTPUT_DIR"):
        monkeypatch.delenv(name, raising=False)
    shutil.copytree(demo_checkpoint, tmp_path / "tiny-llama")
    return tmp_path


def _bonsai(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _jobs() -> list[dict[str, Any]]:
    result = _bonsai("jobs", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)  # type: ignore[no-any-return]


def _show(job_id: int) -> dict[str, Any]:
    result = _bonsai("show", str(job_id), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)  # type: ignore[no-any-return]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_gguf_gets_a_readable_name_never_over_another(workspace: Path) -> None:
    first = _bonsai("convert", "tiny-llama")
    assert first.exit_code == 0, first.output
    named = workspace / "tiny-llama-TQ2_0.gguf"
    detail = _show(1)
    assert _digest(named) == detail["gguf"]["sha256"]
    assert f"gguf      {named}" in first.output and "bonsai show 1" in first.output

    again = _bonsai("convert", "tiny-llama")  # every stage cached; the first copy is kept
    assert again.exit_code == 0, again.output
    assert (workspace / "tiny-llama-TQ2_0-2.gguf").exists()
    named.write_bytes(b"mine")
    forced = _bonsai("convert", "tiny-llama", "--force")
    assert forced.exit_code == 0, forced.output
    assert _digest(named) == detail["gguf"]["sha256"] and not (workspace / "tiny-llama-TQ2_0-3.gguf").exists()
    assert [job["id"] for job in _jobs()] == [1, 2, 3]  # the default home: `bonsai jobs` sees them


def test_out_folders_are_made_and_an_existing_file_is_refused_before_any_job(workspace: Path) -> None:
    into_folder = _bonsai("convert", "tiny-llama", "--recipe", "TQ1_0", "--out", "new/folder/")
    assert into_folder.exit_code == 0, into_folder.output
    assert (workspace / "new/folder/tiny-llama-TQ1_0.gguf").is_file()
    as_file = _bonsai("convert", "tiny-llama", "--recipe", "tq1_0", "--out", "deeper/still/model.gguf")
    assert as_file.exit_code == 0, as_file.output
    assert _digest(workspace / "deeper/still/model.gguf") == _show(2)["gguf"]["sha256"]
    assert _show(2)["recipe"] == "tq1_0"

    refused = _bonsai("convert", "tiny-llama", "--out", "deeper/still/model.gguf")
    assert refused.exit_code == 2
    assert "deeper/still/model.gguf already exists" in refused.output and "--force" in refused.output
    assert len(_jobs()) == 2


def test_a_failed_validation_says_where_the_gguf_is_and_export_takes_it(workspace: Path) -> None:
    failed = _bonsai("convert", "tiny-llama", "--out", "mine.gguf", *FAILING)
    assert failed.exit_code == 1
    detail = _show(1)
    stored = detail["gguf"]["path"]
    assert f"the packaged GGUF is at {stored}" in failed.output
    assert "so it was not copied to mine.gguf" in failed.output
    assert "bonsai export 1 --out PATH --force" in failed.output
    assert not (workspace / "mine.gguf").exists()

    shown = _bonsai("show", "1")
    assert f"the packaged GGUF is at {stored}; to take it anyway: bonsai export 1" in shown.output
    refused = _bonsai("export", "1")
    assert refused.exit_code == 2 and "failed validation" in refused.output and "--force" in refused.output
    taken = _bonsai("export", "1", "--out", "kept/", "--force")
    assert taken.exit_code == 0, taken.output
    written = workspace / "kept/tiny-llama-TQ2_0.gguf"
    assert str(written) in taken.output and _digest(written) == detail["gguf"]["sha256"]


def test_export_of_a_succeeded_job_and_of_one_without_a_gguf(workspace: Path) -> None:
    assert _bonsai("convert", "tiny-llama", "--out", "first.gguf").exit_code == 0
    exported = _bonsai("export", "1")
    assert exported.exit_code == 0, exported.output
    assert _digest(workspace / "tiny-llama-TQ2_0.gguf") == _digest(workspace / "first.gguf")
    (workspace / "empty").mkdir()
    (workspace / "empty" / "config.json").write_text("{}")
    assert _bonsai("convert", "empty").exit_code == 1
    missing = _bonsai("export", "2")
    assert missing.exit_code == 2 and "job 2 (failed) has no packaged GGUF" in missing.output


@pytest.mark.parametrize(("args", "message"), [
    (("--option", "metod=absmean"), "unknown option 'metod'; did you mean 'method'?"),
    (("--recipe", "tq9"), "unknown recipe 'tq9'"),
    (("--option", "embed_type=q4_k"), "expected one of source, F16, BF16, F32, Q8_0"),
    (("--option", "agreement_pass_top1=0.3"), "agreement_fail_top1"),
])
def test_typos_are_refused_before_a_job_row_exists(workspace: Path, args: tuple[str, ...],
                                                   message: str) -> None:
    result = _bonsai("convert", "tiny-llama", *args)
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output
    assert _jobs() == [] and not list(workspace.glob("*.gguf"))


def test_target_picks_the_recipe_and_warns_in_the_job(workspace: Path) -> None:
    result = _bonsai("convert", "tiny-llama", "--target", "cpu", "--recipe", "Q2_0",
                     "--option", "embed_type=f16")
    assert result.exit_code == 0, result.output
    assert "warning Q2_0 runs on cpu only through llama.cpp's generic scalar code" in result.output
    detail = _show(1)
    assert (detail["recipe"], detail["target"], detail["params"]["embed_type"]) == ("q2_0", "cpu", "F16")
    (warning,) = detail["warnings"]
    assert "scalar" in warning and "'tq2_0'" in warning
    assert (workspace / "tiny-llama-Q2_0.gguf").exists()
    help_text = _bonsai("convert", "--help").output
    for name in ("tq2_0", "tq1_0", "q2_0", "q1_0", "embed_type", "agreement_fail_kl", "target", "levels",
                 "auto", "target_bpw", "min_top1", "max_kl"):
        assert name in help_text
    listed = json.loads(_bonsai("recipes", "--json").output)
    assert {row["name"] for row in listed["recipes"]} == {"tq2_0", "tq1_0", "q2_0", "q1_0", "auto"}
    assert "method" in {row["key"] for row in listed["options"]}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_leads_to_a_named_gguf_and_its_job(workspace: Path) -> None:
    """The demo target's own commands in a clean folder: a named GGUF, and `bonsai show` finds the job."""
    root = Path(__file__).resolve().parents[2]
    planned = subprocess.run(["make", "-s", "-n", "-o", ".venv/bin/.installed", "demo"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert planned and all(line.startswith(".venv/bin/bonsai ") for line in planned), planned
    env = {**os.environ, "PYTHONPATH": str(root)}
    for _ in range(2):  # a rerun replaces the demo's own file
        for line in planned:
            args = shlex.split(line)[1:]
            assert "--home" not in args  # the default home, where `bonsai jobs` looks
            done = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=workspace, env=env,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
    assert "bonsai show 2" in done.stdout
    assert sorted(p.name for p in workspace.glob("*.gguf")) == ["tiny-llama-TQ2_0.gguf"]
    assert _digest(workspace / "tiny-llama-TQ2_0.gguf") == _show(2)["gguf"]["sha256"]
