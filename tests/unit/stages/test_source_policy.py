"""Which local paths a submitter may name, and which files of a source are ever taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.errors import InputError
from pipeline.stages import download
from pipeline.stages.base import JobSpec, StageClients
from pipeline.stages.sources import SourcePolicy, is_checkpoint_file


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    models, secrets = tmp_path / "models", tmp_path / "secrets"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text("{}")
    secrets.mkdir()
    (secrets / "id_rsa").write_text("key")
    (models / "linked").symlink_to(secrets)
    return models, secrets


def test_api_policy_without_roots_takes_hub_ids_only(tmp_path: Path) -> None:
    models, _ = _tree(tmp_path)
    policy = SourcePolicy.from_roots([], allow_any_local=False)
    assert policy.check("org/name@main").kind == "hub"
    with pytest.raises(InputError, match="local paths are not accepted here.*BONSAI_SOURCE_ROOTS"):
        policy.check(str(models / "llama"))


@pytest.mark.parametrize("allow_any_local", [False, True])
def test_roots_confine_after_resolving_symlinks_and_dotdot(tmp_path: Path, allow_any_local: bool) -> None:
    models, secrets = _tree(tmp_path)
    policy = SourcePolicy.from_roots([str(models)], allow_any_local=allow_any_local)
    assert policy.check(str(models / "llama")).kind == "local"
    for escape in (secrets, models / "linked", models / ".." / "secrets", f"{models}/llama/../../secrets"):
        with pytest.raises(InputError, match="outside the allowed model folders"):
            policy.check(str(escape))


def test_cli_policy_without_roots_allows_the_users_own_paths(tmp_path: Path) -> None:
    _, secrets = _tree(tmp_path)
    assert SourcePolicy.from_roots([], allow_any_local=True).check(str(secrets)).kind == "local"


def test_the_download_stage_checks_the_policy_again(tmp_path: Path) -> None:
    models, secrets = _tree(tmp_path)
    policy = SourcePolicy.from_roots([str(models)], allow_any_local=True)
    (tmp_path / "work").mkdir()
    with pytest.raises(InputError, match="outside the allowed model folders"):
        download.run(download.make_params(JobSpec(str(models / "linked"))), {}, tmp_path / "work",
                     StageClients(source_policy=policy))


@pytest.mark.parametrize("name, taken", [
    ("model-00001-of-00002.safetensors", True), ("model.safetensors.index.json", True), ("x.gguf", True),
    ("config.json", True), ("tokenizer.model", True), ("SHA256SUMS", True), ("LICENSE.txt", True),
    ("README.md", True), ("quantize_config.json", True),
    ("id_rsa", False), (".env", False), ("pytorch_model.bin", False), ("sub/config.json", False),
    ("notes.txt", False), ("hub_files.json", False),
])
def test_the_allow_list(name: str, taken: bool) -> None:
    assert is_checkpoint_file(name) is taken


def test_pickle_only_folder_fails_at_download(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (tmp_path / "work").mkdir()
    with pytest.raises(InputError, match="pickle-only checkpoint.*pytorch_model.bin"):
        download.run(download.make_params(JobSpec(str(src))), {}, tmp_path / "work")
