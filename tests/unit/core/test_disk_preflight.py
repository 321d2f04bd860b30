"""Stages refuse work the disk cannot hold before they write anything, naming both numbers."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from pipeline.core import files
from pipeline.core.errors import InputError
from pipeline.stages import download
from pipeline.stages.base import JobSpec

_Usage = namedtuple("_Usage", "total used free")


def _disk_with_free(monkeypatch: pytest.MonkeyPatch, free_bytes: int) -> None:
    # The one thing faked: how much the file system reports free (filling a real disk is no test).
    usage = _Usage(10**12, 10**12 - free_bytes, free_bytes)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _path: usage)


def test_require_free_space_names_both_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _disk_with_free(monkeypatch, 1_000_000_000)
    assert files.require_free_space(tmp_path, 100, "a test") == 1_000_000_000
    with pytest.raises(InputError) as info:
        files.require_free_space(tmp_path, 5_000_000_000, "the parts")
    message = str(info.value)
    assert "needs 5.00 GB" in message and "1.00 GB free" in message and "BONSAI_WORK_ROOT" in message


def test_download_copies_are_checked_before_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"\0" * 4096)
    work = tmp_path / "work"
    work.mkdir()
    _disk_with_free(monkeypatch, 0)
    # Same file system: hard links, nothing to copy, so even a full disk takes it.
    result = download.run(download.make_params(JobSpec(str(src))), {}, work)
    assert result.metrics["hardlinked_count"] == 2
    monkeypatch.setattr(download, "_bytes_to_copy", lambda found, workdir: 8 << 30)
    shutil.rmtree(work)
    work.mkdir()
    with pytest.raises(InputError, match="not enough disk space for the files of"):
        download.run(download.make_params(JobSpec(str(src))), {}, work)
    assert list(work.iterdir()) == []  # refused before anything was written
