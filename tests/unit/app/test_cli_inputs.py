"""The CLI checks a job's inputs before it touches a broker or makes a row, and says where jobs live."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pipeline.app.cli import cli

# Nothing listens here: a command that reached the broker would fail differently (or hang).
DEAD_BROKER = "redis://127.0.0.1:9/0"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("BONSAI_HOME", "BONSAI_DATABASE_URL", "BONSAI_BROKER_URL", "BONSAI_ARTIFACT_ROOT"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / ".bonsai"


def _bonsai(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize(("args", "message"), [
    (("--recipe", "tq9"), "unknown recipe 'tq9'"),
    (("--option", "metod=absmean"), "did you mean 'method'?"),
    (("--target", "cuda", "--option", "levels=5"), "option levels='5'; expected at most 4"),
])
def test_submit_refuses_bad_inputs_before_the_broker(home: Path, args: tuple[str, ...], message: str) -> None:
    result = _bonsai("--broker-url", DEAD_BROKER, "submit", "org/model@main", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output
    assert not (home / "bonsai.db").exists()  # no database made, so no job row either


def test_submit_checks_every_manifest_entry_and_names_the_bad_one(home: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("- org/a@main\n- source: org/b@main\n  recipe: TQ2_0\n  options: {embed_type: f4}\n")
    result = _bonsai("--broker-url", DEAD_BROKER, "submit", "--manifest", str(manifest))
    assert result.exit_code == 2
    assert f"manifest {manifest}, entry 2: option embed_type='f4'; expected one of" in result.output


def test_jobs_and_show_in_a_home_that_has_no_database_say_so_and_make_none(home: Path) -> None:
    listed = _bonsai("jobs", "--json")
    assert listed.exit_code == 0
    assert "no jobs here: there is no database at" in listed.output
    assert "--home or BONSAI_HOME" in listed.output
    assert json.loads(listed.stdout) == []
    shown = _bonsai("show", "1")
    assert shown.exit_code == 2 and "job 1 does not exist: no jobs here" in shown.output
    assert not home.exists()


def test_recipes_lists_every_recipe_and_option() -> None:
    result = _bonsai("recipes")
    assert result.exit_code == 0
    for word in ("tq2_0", "TQ2_0", "q1_0", "picked by --target cuda", "embed_type", "F16|BF16|F32|Q8_0",
                 "target"):
        assert word in result.output


def test_the_cli_targets_are_the_backend_tables() -> None:
    from pipeline.app.cli.main import TARGET_CHOICES
    from pipeline.ternary.backends import TARGETS

    assert TARGET_CHOICES == TARGETS
