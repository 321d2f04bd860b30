"""copy_and_hash: the digest is the copy's, across chunk boundaries, on both the kernel and the plain path."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pipeline.artifacts import copying


def _copy(tmp_path: Path, data: bytes) -> tuple[str, int, bytes]:
    source = tmp_path / "source"
    source.write_bytes(data)
    dest = tmp_path / "dest"
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        digest, size_bytes = copying.copy_and_hash(source, fd)
    finally:
        os.close(fd)
    return digest, size_bytes, dest.read_bytes()


@pytest.mark.parametrize("size_bytes", [0, 1, 4095, 3 * 65536 + 17])
def test_kernel_copy_in_many_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size_bytes: int) -> None:
    # Small chunks, read buffers and sync steps so a small file crosses every boundary.
    monkeypatch.setattr(copying, "_CHUNK_BYTES", 65536)
    monkeypatch.setattr(copying, "_READ_BYTES", 4096)
    monkeypatch.setattr(copying, "_SYNC_EVERY_BYTES", 65536)
    data = os.urandom(size_bytes)
    digest, copied, written = _copy(tmp_path, data)
    assert (digest, copied, written) == (hashlib.sha256(data).hexdigest(), size_bytes, data)


def test_plain_copy_when_the_kernel_cannot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def refuse(*args: object) -> int:
        calls.append(args)
        raise OSError(18, "Invalid cross-device link")  # EXDEV, as old kernels answer across file systems

    monkeypatch.setattr(copying.os, "copy_file_range", refuse)
    data = os.urandom(100_000)
    digest, copied, written = _copy(tmp_path, data)
    assert calls, "the kernel copy was tried first"
    assert (digest, copied, written) == (hashlib.sha256(data).hexdigest(), len(data), data)


def test_other_copy_errors_propagate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(copying.os, "copy_file_range", disk_full)
    with pytest.raises(OSError, match="No space"):
        _copy(tmp_path, b"x" * 1000)
