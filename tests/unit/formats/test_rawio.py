"""The safetensors tensor reader: row-order tensors come as private mappings of the file, not copies."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.core.errors import IntegrityError
from pipeline.formats.rawio import SafetensorsReader


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "a.weight": torch.randn(33, 256).to(torch.bfloat16),  # starts at an offset no page boundary meets
        "b.weight": torch.randn(7, 300),
        "c.bias": torch.randn(5).to(torch.float16),
    }
    save_file(tensors, str(path))
    return tensors


def test_tensors_read_as_stored_and_as_float32(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = _checkpoint(path)
    with SafetensorsReader(path) as reader:
        for name, expected in tensors.items():
            stored = reader.tensor(name, as_stored=True)
            assert stored.dtype == expected.dtype and torch.equal(stored, expected)
            assert torch.equal(reader.float32(name), expected.to(torch.float32))
        order = torch.arange(33).flip(0)
        flipped = reader.tensor("a.weight", row_order=order, as_stored=True)
        assert torch.equal(flipped, tensors["a.weight"][order])


def test_a_write_to_a_mapped_tensor_never_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = _checkpoint(path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with SafetensorsReader(path) as reader:
        stored = reader.tensor("a.weight", as_stored=True)
        stored.mul_(2)  # copy-on-write: this process's pages only
        assert torch.equal(stored, tensors["a.weight"] * 2)
        assert torch.equal(reader.tensor("a.weight", as_stored=True), tensors["a.weight"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_a_file_cut_short_after_its_header_was_read_is_an_integrity_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    _checkpoint(path)
    with SafetensorsReader(path) as reader:
        last = max(reader.entries.values(), key=lambda entry: entry.begin)
        with open(path, "r+b") as handle:
            handle.truncate(last.begin + 1)
        with pytest.raises(IntegrityError, match=r"file ended before model.safetensors.s tensor"):
            reader.tensor(last.name, as_stored=True)
