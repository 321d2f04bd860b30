"""HfHubClient and the download stage against a hand-built huggingface_hub cache, offline.

Nothing here opens a connection: the client runs with is_offline=True and the process-wide
HF_HUB_OFFLINE switch is also turned on, so a slip would raise instead of reaching the hub.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.clients.hub import HfHubClient, HubFile, is_commit_sha
from pipeline.core.errors import InputError, TransientError, UnreachableError
from pipeline.stages import checksum, download
from pipeline.stages.base import InputFile, JobSpec, StageClients
from pipeline.stages.sources import is_checkpoint_file
from tests.support.hub_cache import COMMIT, REPO, build_hub_cache


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}',
    "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    "tokenizer/tokenizer.json": b"{}",
}


def test_is_commit_sha() -> None:
    assert is_commit_sha(COMMIT)
    assert not is_commit_sha("main")
    assert not is_commit_sha(COMMIT.upper())


def test_resolve_branch_and_sha_offline(tmp_path: Path) -> None:
    build_hub_cache(tmp_path, FILES, refs=("main", "v1.0"))
    hub = HfHubClient(cache_dir=tmp_path, is_offline=True)
    assert hub.resolve_revision(REPO, None) == COMMIT
    assert hub.resolve_revision(REPO, "v1.0") == COMMIT
    assert hub.resolve_revision(REPO, COMMIT) == COMMIT


def test_unknown_revision_offline_is_input_error(tmp_path: Path) -> None:
    build_hub_cache(tmp_path, FILES)
    hub = HfHubClient(cache_dir=tmp_path, is_offline=True)
    with pytest.raises(InputError, match="'nope'.*offline"):
        hub.resolve_revision(REPO, "nope")


def test_listing_from_cached_tree_carries_lfs_sha256(tmp_path: Path) -> None:
    build_hub_cache(tmp_path, FILES)
    listing = HfHubClient(cache_dir=tmp_path, is_offline=True).list_files_with_sha256(REPO, COMMIT)
    by_name = {item.name: item for item in listing}
    assert set(by_name) == set(FILES)
    weights = FILES["model.safetensors"]
    assert by_name["model.safetensors"] == HubFile(
        "model.safetensors", len(weights), hashlib.sha256(weights).hexdigest()
    )
    assert by_name["config.json"].sha256 is None


def test_listing_without_tree_cache_is_empty(tmp_path: Path) -> None:
    build_hub_cache(tmp_path, FILES, with_tree=False)
    assert HfHubClient(cache_dir=tmp_path, is_offline=True).list_files_with_sha256(REPO, COMMIT) == []


def test_download_stage_from_offline_cache_then_checksum(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    build_hub_cache(cache, FILES)
    hub = HfHubClient(cache_dir=cache, is_offline=True)
    work = tmp_path / "work"
    work.mkdir()
    params = download.make_params(JobSpec(source=f"{REPO}@main"))
    result = download.run(params, {}, work, StageClients(hub=hub))

    names = {o.name: o for o in result.outputs}
    # The sub-folder's tokenizer is not a checkpoint file: listed as left out, never fetched or stored.
    assert set(names) == {n for n in FILES if is_checkpoint_file(n)} | {"hub_files.json"}
    assert "tokenizer/tokenizer.json" in result.metrics["left_out"]
    assert result.metrics["source_kind"] == "hub"
    assert result.metrics["resolved_revision"] == COMMIT
    assert result.metrics["repo_id"] == REPO
    assert result.metrics["hub_sha256_count"] == 1
    assert not names["model.safetensors"].path.is_symlink()
    assert names["hub_files.json"].kind == "hub-metadata"

    inputs = {
        f"download/{o.name}": InputFile(o.name, o.path, hashlib.sha256(o.path.read_bytes()).hexdigest(),
                                        o.path.stat().st_size)
        for o in result.outputs
    }
    check_dir = tmp_path / "check"
    check_dir.mkdir()
    checked = checksum.run(checksum.Params(), inputs, check_dir)
    assert checked.metrics["verified_against"] == ["hub_files.json"]


def test_download_stage_unknown_repo_offline(tmp_path: Path) -> None:
    hub = HfHubClient(cache_dir=tmp_path, is_offline=True)
    with pytest.raises(InputError, match="acme/missing"):
        download.run(download.Params("acme/missing"), {}, tmp_path, StageClients(hub=hub))


def test_incomplete_snapshot_offline_is_input_error(tmp_path: Path) -> None:
    repo = build_hub_cache(tmp_path, FILES)
    (repo / "snapshots" / COMMIT / "config.json").unlink()
    hub = HfHubClient(cache_dir=tmp_path, is_offline=True)
    with pytest.raises(InputError, match="local hub cache"):
        hub.download_snapshot(REPO, COMMIT)


def test_http_errors_are_translated(tmp_path: Path) -> None:
    import httpx2
    from huggingface_hub import errors as hf_errors

    hub = HfHubClient(cache_dir=tmp_path, is_offline=False)
    request = httpx2.Request("GET", "https://hub.invalid/api/models/acme/x")

    def fail(exc: BaseException) -> None:
        with hub._translate(REPO, "main"):
            raise exc

    def http(cls: type[hf_errors.HfHubHTTPError], status: int) -> hf_errors.HfHubHTTPError:
        return cls("boom", response=httpx2.Response(status, request=request))

    with pytest.raises(TransientError, match="HTTP 503"):
        fail(http(hf_errors.HfHubHTTPError, 503))
    with pytest.raises(InputError, match="no such repo"):
        fail(http(hf_errors.RepositoryNotFoundError, 404))
    with pytest.raises(InputError, match="revision does not exist"):
        fail(http(hf_errors.RevisionNotFoundError, 404))
    with pytest.raises(UnreachableError, match="cannot be reached.*HF_HUB_OFFLINE=1"):
        fail(httpx2.ConnectError("refused", request=request))
    with pytest.raises(TransientError, match="network failure"):
        fail(httpx2.ReadTimeout("slow", request=request))
    with pytest.raises(TransientError, match="could not be reached in time"):
        fail(hf_errors.RevisionResolutionError("no network"))


def test_the_servers_token_goes_only_to_the_listed_repos() -> None:
    listed = HfHubClient(token="hf_operator", token_repos=("Acme", "other/llama-*"))
    assert listed._token_for("acme/private") == "hf_operator"
    assert listed._token_for("other/llama-7b") == "hf_operator"
    # Anonymous (False: not even huggingface_hub's saved login) for everything else.
    assert listed._token_for("other/mistral") is False and listed._token_for("gated/model") is False
    assert HfHubClient(token="hf_operator", token_repos=())._token_for("acme/x") is False
    assert HfHubClient(token="hf_cli")._token_for("any/repo") == "hf_cli"
