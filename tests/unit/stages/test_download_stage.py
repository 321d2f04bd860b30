"""Download stage: source spec forms, hostile names and symlinks, hub pinning via a fake client."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.clients.hub import HubFile
from pipeline.core.errors import InputError, TransientError
from pipeline.stages import download
from pipeline.stages.base import JobSpec, StageClients
from pipeline.stages.sources import SourceSpec, parse_source

SHA = "fedcba9876543210fedcba9876543210fedcba98"


class FakeHub:
    """A HubClient serving one folder as the snapshot of every repo at one commit."""

    def __init__(self, folder: Path, files: list[HubFile] | None = None, error: Exception | None = None):
        self.folder = folder
        self.files = files or []
        self.error = error
        self.calls: list[tuple[str, ...]] = []

    def resolve_revision(self, repo_id: str, revision: str | None) -> str:
        self.calls.append(("resolve", repo_id, revision or ""))
        if self.error is not None:
            raise self.error
        return SHA

    def list_files_with_sha256(self, repo_id: str, commit_sha: str) -> list[HubFile]:
        self.calls.append(("list", repo_id, commit_sha))
        return self.files

    def download_snapshot(self, repo_id: str, commit_sha: str, allow_patterns: Any = None) -> Path:
        self.calls.append(("download", repo_id, commit_sha))
        return self.folder


def _folder(root: Path) -> Path:
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"x" * 100)
    (src / "sub" / "tokenizer.json").write_text("{}")
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / ".cache" / "huggingface").mkdir(parents=True)
    (src / ".cache" / "huggingface" / "x.lock").write_text("")
    return src


def _run(source: str, work: Path, **clients: object) -> download.StageResult:
    work.mkdir(exist_ok=True)
    return download.run(download.make_params(JobSpec(source=source)), {}, work, StageClients(**clients))


def test_local_folder(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    result = _run(str(src), tmp_path / "work")
    names = sorted(o.name for o in result.outputs)
    # Only checkpoint files at the top level are taken; the rest are named, never stored.
    assert names == ["config.json", "model.safetensors"]
    assert result.metrics["left_out"] == [".gitattributes", "sub/tokenizer.json"]
    assert any("2 file(s) are not checkpoint files" in w for w in result.warnings)
    assert all(o.kind == "source-file" for o in result.outputs)
    for out in result.outputs:
        assert out.path == tmp_path / "work" / "snapshot" / out.name
        assert out.path.read_bytes() == (src / out.name).read_bytes()
    assert result.metrics["source_kind"] == "local"
    assert result.metrics["file_count"] == 2
    assert result.metrics["total_bytes"] == sum((src / n).stat().st_size for n in names)


def test_single_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "model-f16.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 20)
    result = _run(str(gguf), tmp_path / "work")
    assert [o.name for o in result.outputs] == ["model-f16.gguf"]
    assert result.metrics["source_kind"] == "gguf"


@pytest.mark.parametrize("source", ["/no/such/folder", "./missing", "missing.gguf", "not a spec!"])
def test_missing_source_names_spec_and_forms(tmp_path: Path, source: str) -> None:
    with pytest.raises(InputError) as info:
        _run(source, tmp_path / "work")
    assert repr(source) in str(info.value)
    assert "org/name@revision" in str(info.value)


def test_plain_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(InputError, match="not a .gguf file"):
        _run(str(path), tmp_path / "work")


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no checkpoint files"):
        _run(str(tmp_path / "empty"), tmp_path / "work")


def test_symlink_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (src / "leak.json").symlink_to(secret)
    with pytest.raises(InputError, match="leak.json.*outside the source folder"):
        _run(str(src), tmp_path / "work")


def test_folder_symlink_escaping_is_refused(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    (src / "etc").symlink_to("/etc")
    with pytest.raises(InputError, match="outside the source folder"):
        _run(str(src), tmp_path / "work")


def test_symlink_inside_the_folder_is_followed(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    (src / "tokenizer_config.json").symlink_to("config.json")
    result = _run(str(src), tmp_path / "work")
    alias = next(o for o in result.outputs if o.name == "tokenizer_config.json")
    assert not alias.path.is_symlink() and alias.path.read_text() == "{}"


def test_broken_symlink_is_refused(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    (src / "dangling.json").symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError, match="broken"):
        _run(str(src), tmp_path / "work")


def test_fifo_is_refused(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    os.mkfifo(src / "pipe")
    with pytest.raises(InputError, match="not a regular file"):
        _run(str(src), tmp_path / "work")


def test_reserved_hub_files_name_is_never_taken(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    (src / "hub_files.json").write_text("{}")
    result = _run(str(src), tmp_path / "work")
    assert "hub_files.json" not in {o.name for o in result.outputs}
    assert "hub_files.json" in result.metrics["left_out"]


def test_parse_source_forms(tmp_path: Path) -> None:
    assert parse_source("org/name") == SourceSpec("hub", repo_id="org/name")
    assert parse_source("hf://org/name@v1.0") == SourceSpec(
        "hub", repo_id="org/name", revision="v1.0"
    )
    assert parse_source(f"org/name@{SHA}").revision == SHA
    for bad in ("org/na--me", "org/../x", "a/b/c", "org/name@", "@main"):
        with pytest.raises(InputError):
            parse_source(bad)
    # An existing folder wins over a hub id of the same spelling.
    (tmp_path / "org" / "name").mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert parse_source("org/name").kind == "local"
    finally:
        os.chdir(cwd)


def test_hub_pins_revision_and_writes_hub_files(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    listing = [HubFile("config.json", 2), HubFile("model.safetensors", 100, "ab" * 32)]
    hub = FakeHub(src, listing)
    result = _run("acme/llama@main", tmp_path / "work", hub=hub)
    assert hub.calls[0] == ("resolve", "acme/llama", "main")
    assert ("download", "acme/llama", SHA) in hub.calls
    assert result.metrics["resolved_revision"] == SHA
    assert result.metrics["requested_revision"] == "main"
    assert result.metrics["hub_sha256_count"] == 1
    meta = next(o for o in result.outputs if o.name == "hub_files.json")
    assert meta.kind == "hub-metadata"
    document = json.loads(meta.path.read_text())
    assert document["revision"] == SHA and document["repo_id"] == "acme/llama"
    assert document["files"][1] == {"name": "model.safetensors", "size_bytes": 100, "sha256": "ab" * 32}


def test_hub_listing_with_traversal_name_is_refused(tmp_path: Path) -> None:
    hub = FakeHub(_folder(tmp_path), [HubFile("../../etc/passwd", 1)])
    with pytest.raises(InputError, match="escapes"):
        _run("acme/llama", tmp_path / "work", hub=hub)


def test_hub_errors_propagate_with_their_kind(tmp_path: Path) -> None:
    hub = FakeHub(tmp_path, error=TransientError("hub answered HTTP 503"))
    with pytest.raises(TransientError):
        _run("acme/llama", tmp_path / "work", hub=hub)
    hub = FakeHub(tmp_path, error=InputError("no such repo"))
    with pytest.raises(InputError):
        _run("acme/llama", tmp_path / "work2", hub=hub)


def test_hub_snapshot_symlinks_may_point_into_blobs_only(tmp_path: Path) -> None:
    repo = tmp_path / "models--acme--llama"
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "abc").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/abc")
    result = _run("acme/llama", tmp_path / "work", hub=FakeHub(snap))
    assert {o.name for o in result.outputs} == {"config.json", "hub_files.json"}
    assert result.warnings  # empty listing: nothing to verify against

    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (snap / "evil.json").symlink_to(outside)
    with pytest.raises(InputError, match="evil.json"):
        _run("acme/llama", tmp_path / "work2", hub=FakeHub(snap))


def test_cache_identity_pins_hub_commit_and_never_reuses_local(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    hub = FakeHub(src)
    clients = StageClients(hub=hub)
    assert download.cache_identity(download.Params("acme/llama@main"), clients) == f"hub:acme/llama@{SHA}"
    assert download.cache_identity(download.Params(str(src)), clients) is None
    assert hub.calls == [("resolve", "acme/llama", "main")]
