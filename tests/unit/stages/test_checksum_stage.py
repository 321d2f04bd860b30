"""Checksum stage: manifest, SHA256SUMS and hub-listing verification, and every mismatch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.sums import parse_sha256sums
from pipeline.stages import checksum
from pipeline.stages.base import InputFile, StageClients


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inputs(
    root: Path, files: dict[str, bytes], *, stored: dict[str, str] | None = None
) -> dict[str, InputFile]:
    inputs = {}
    for name, data in files.items():
        path = root / "snap" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        digest = (stored or {}).get(name, _sha(data))
        inputs[f"download/{name}"] = InputFile(name, path, digest, len(data))
    return inputs


def _run(tmp_path: Path, inputs: dict[str, InputFile]) -> checksum.StageResult:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return checksum.run(checksum.make_params(None), inputs, work)  # type: ignore[arg-type]


FILES = {"config.json": b"{}", "model.safetensors": b"weights" * 1000, "sub/tok.json": b"[]"}


def test_manifest_without_references(tmp_path: Path) -> None:
    result = _run(tmp_path, _inputs(tmp_path, FILES))
    (out,) = result.outputs
    assert out.name == "manifest.json" and out.kind == "manifest"
    document = json.loads(out.path.read_text())
    assert document["files"] == [
        {"name": name, "sha256": _sha(data), "size_bytes": len(data)} for name, data in sorted(FILES.items())
    ]
    assert document["verified_against"] == []
    assert result.warnings and "not verified" in result.warnings[0]
    assert result.metrics["total_bytes"] == sum(len(d) for d in FILES.values())


def test_sha256sums_both_formats_verified(tmp_path: Path) -> None:
    sums = (
        f"{_sha(FILES['config.json'])}  config.json\n"
        f"{_sha(FILES['model.safetensors']).upper()} *./model.safetensors\n"
        f"# comment\n\nSHA256 (sub/tok.json) = {_sha(FILES['sub/tok.json'])}\n"
    )
    result = _run(tmp_path, _inputs(tmp_path, {**FILES, "SHA256SUMS": sums.encode()}))
    assert result.metrics["verified_against"] == ["SHA256SUMS"]
    names = [f["name"] for f in json.loads(result.outputs[0].path.read_text())["files"]]
    assert "SHA256SUMS" in names


def test_sha256sums_mismatch_names_file_and_digests(tmp_path: Path) -> None:
    wrong = "0" * 64
    sums = f"{wrong}  model.safetensors\n{_sha(b'{}')}  config.json\n"
    with pytest.raises(IntegrityError) as info:
        _run(tmp_path, _inputs(tmp_path, {**FILES, "SHA256SUMS": sums.encode()}))
    message = str(info.value)
    assert "model.safetensors" in message and "SHA256SUMS" in message
    assert f"expected {wrong}" in message
    assert f"actual {_sha(FILES['model.safetensors'])}" in message
    assert "config.json" not in message


def test_sha256sums_listed_file_missing(tmp_path: Path) -> None:
    sums = f"{_sha(b'x')}  model-00002-of-00002.safetensors\n"
    with pytest.raises(IntegrityError, match="model-00002-of-00002.safetensors.*missing"):
        _run(tmp_path, _inputs(tmp_path, {**FILES, "SHA256SUMS": sums.encode()}))


def test_sha256sums_malformed_line(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="line 1"):
        _run(tmp_path, _inputs(tmp_path, {**FILES, "SHA256SUMS": b"deadbeef config.json\n"}))


def test_sha256sums_traversal_name(tmp_path: Path) -> None:
    sums = f"{_sha(b'x')}  ../../etc/passwd\n"
    with pytest.raises(InputError, match="escapes"):
        _run(tmp_path, _inputs(tmp_path, {**FILES, "SHA256SUMS": sums.encode()}))


def test_parse_sha256sums_conflicting_duplicates() -> None:
    text = f"{'a' * 64}  x\n{'b' * 64}  x\n"
    with pytest.raises(IntegrityError, match="twice"):
        parse_sha256sums(text)


def _hub_files(entries: list[dict[str, object]]) -> bytes:
    return json.dumps({"repo_id": "a/b", "revision": "c" * 40, "files": entries}).encode()


def test_hub_listing_verified(tmp_path: Path) -> None:
    hub = _hub_files([
        {"name": "model.safetensors", "size_bytes": 7000, "sha256": _sha(FILES["model.safetensors"])},
        {"name": "config.json", "size_bytes": 2, "sha256": None},
    ])
    result = _run(tmp_path, _inputs(tmp_path, {**FILES, "hub_files.json": hub}))
    assert result.metrics["verified_against"] == ["hub_files.json"]
    document = json.loads(result.outputs[0].path.read_text())
    assert "hub_files.json" not in [f["name"] for f in document["files"]]
    assert any("sub/tok.json" in w for w in result.warnings)


def test_hub_sha256_mismatch(tmp_path: Path) -> None:
    expected = "f" * 64
    hub = _hub_files([{"name": "model.safetensors", "size_bytes": 7000, "sha256": expected}])
    with pytest.raises(IntegrityError) as info:
        _run(tmp_path, _inputs(tmp_path, {**FILES, "hub_files.json": hub}))
    message = str(info.value)
    assert "model.safetensors" in message and "hub" in message
    assert expected in message and _sha(FILES["model.safetensors"]) in message


def test_hub_size_mismatch_and_missing(tmp_path: Path) -> None:
    hub = _hub_files([
        {"name": "config.json", "size_bytes": 3, "sha256": None},
        {"name": "gone.safetensors", "size_bytes": 3, "sha256": "1" * 64},
    ])
    with pytest.raises(IntegrityError) as info:
        _run(tmp_path, _inputs(tmp_path, {**FILES, "hub_files.json": hub}))
    assert "config.json: size mismatch" in str(info.value)
    assert "gone.safetensors: listed by the hub" in str(info.value)


def test_store_digest_disagreeing_with_bytes(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path, FILES, stored={"config.json": "e" * 64})
    with pytest.raises(IntegrityError, match=f"config.json.*expected {'e' * 64}, actual {_sha(b'{}')}"):
        _run(tmp_path, inputs)


def test_no_inputs(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no download"):
        _run(tmp_path, {})


def test_hash_file_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc" * 100_000)
    digest = checksum.hash_file("f", path)
    assert digest.sha256 == _sha(b"abc" * 100_000) and digest.size_bytes == 300_000


def test_files_the_store_wrote_are_not_read_again_unless_changed(tmp_path: Path) -> None:
    import os
    import time

    from pipeline.artifacts import LocalStore

    store = LocalStore(tmp_path / "store")
    inputs = {}
    for name, data in FILES.items():
        source = tmp_path / "src" / name
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_bytes(data)
        os.link(source, tmp_path / f"alias-{name.replace('/', '_')}")  # a second name: the store copies
        stored = store.put(source)
        inputs[f"download/{name}"] = InputFile(name, store.path(stored.sha256), stored.sha256, len(data))
    work = tmp_path / "work"
    work.mkdir()
    result = checksum.run(checksum.make_params(None), inputs, work, StageClients(store_witness=store))
    assert result.metrics["witnessed_count"] == len(FILES) and result.metrics["hashed_bytes"] == 0
    names = json.loads(result.outputs[0].path.read_text())["files"]
    assert [f["sha256"] for f in names] == [_sha(data) for _, data in sorted(FILES.items())]

    tampered = inputs["download/config.json"].path
    time.sleep(0.02)  # past the clock tick kernels before 6.13 stamp files with (LocalStore.witnessed)
    os.chmod(tampered, 0o644)
    tampered.write_bytes(b"[]")
    with pytest.raises(IntegrityError, match="config.json.*stored copy corrupted"):
        checksum.run(checksum.make_params(None), inputs, tmp_path / "work", StageClients(store_witness=store))
