"""Safetensors header parsing: real files from safetensors.torch, and every way a header can lie."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.safetensors import MAX_HEADER_BYTES, read_header


def _real(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "a.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
            "b.bias": torch.ones(8, dtype=torch.float32),
            "c.empty": torch.zeros(0, 3, dtype=torch.float16),
            "d.scalar": torch.tensor(1.0, dtype=torch.float32),
        },
        str(path),
        metadata={"format": "pt"},
    )
    return path


def _craft(path: Path, header: dict[str, Any], data_bytes: int, *, raw: bytes | None = None) -> Path:
    """Write a file with an arbitrary header and `data_bytes` of zero data."""
    blob = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * data_bytes)
    return path


def test_reads_real_file(tmp_path: Path) -> None:
    path = _real(tmp_path)
    header = read_header(path)
    by_name = {t.name: t for t in header.tensors}
    assert set(by_name) == {"a.weight", "b.bias", "c.empty", "d.scalar"}
    assert by_name["a.weight"].dtype == "BF16" and by_name["a.weight"].shape == (4, 8)
    assert by_name["a.weight"].numel == 32 and by_name["a.weight"].size_bytes == 64
    assert by_name["d.scalar"].shape == () and by_name["d.scalar"].numel == 1
    assert header.metadata == {"format": "pt"}
    assert header.tensors[-1].end == path.stat().st_size
    assert header.data_start == 8 + header.header_size_bytes


def test_truncated_file_names_tensor_and_sizes(tmp_path: Path) -> None:
    path = _real(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(IntegrityError) as info:
        read_header(path)
    message = str(info.value)
    assert message.startswith("model.safetensors: tensor")
    assert repr(last) in message
    assert f"ends at byte {len(data)} but the file has {len(data) - 10} bytes (truncated?)" in message


def test_header_too_large(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(IntegrityError, match=r"big.safetensors: header length 100000001 bytes exceeds"):
        read_header(path)


def test_header_longer_than_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(IntegrityError, match="only 10 bytes"):
        read_header(path)


def test_too_short_for_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(IntegrityError, match="too short"):
        read_header(path)


def test_overlapping_offsets(tmp_path: Path) -> None:
    header = {
        "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    path = _craft(tmp_path / "m.safetensors", header, 24)
    with pytest.raises(IntegrityError, match=r"tensor 'y' bytes \[\d+, \d+\) overlap tensor 'x'"):
        read_header(path)


def test_gap_between_tensors(tmp_path: Path) -> None:
    header = {
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "y": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    with pytest.raises(IntegrityError, match="4 unclaimed bytes.*after tensor 'x'.*before tensor 'y'"):
        read_header(_craft(tmp_path / "m.safetensors", header, 20))


def test_trailing_bytes(tmp_path: Path) -> None:
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    with pytest.raises(IntegrityError, match="5 trailing bytes"):
        read_header(_craft(tmp_path / "m.safetensors", header, 13))


def test_shape_times_dtype_must_match_span(tmp_path: Path) -> None:
    header = {"w": {"dtype": "BF16", "shape": [3, 3], "data_offsets": [0, 36]}}
    with pytest.raises(IntegrityError, match=r"tensor 'w': shape \[3, 3\] x BF16 needs 18 bytes .* span 36"):
        read_header(_craft(tmp_path / "m.safetensors", header, 36))


def test_unknown_dtype_is_input_error(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}
    with pytest.raises(InputError, match="tensor 'w': dtype 'F4' is not supported"):
        read_header(_craft(tmp_path / "m.safetensors", header, 1))


@pytest.mark.parametrize(
    ("entry", "pattern"),
    [
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "non-negative"),
        ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "non-negative"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "begin <= end"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "begin <= end"),
        ({"shape": [1], "data_offsets": [0, 4]}, "dtype"),
        ([1, 2], "not an object"),
    ],
)
def test_malformed_entries(tmp_path: Path, entry: Any, pattern: str) -> None:
    with pytest.raises(IntegrityError, match=pattern):
        read_header(_craft(tmp_path / "m.safetensors", {"w": entry}, 4))


def test_duplicate_keys_refused(tmp_path: Path) -> None:
    raw = (
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
        b' "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    )
    with pytest.raises(IntegrityError, match="'w' twice"):
        read_header(_craft(tmp_path / "m.safetensors", {}, 4, raw=raw))


@pytest.mark.parametrize("raw", [b"not json at all", b"{broken", b"\xff\xfe{}", b"[1, 2]"])
def test_not_json(tmp_path: Path, raw: bytes) -> None:
    with pytest.raises(IntegrityError, match="m.safetensors: header"):
        read_header(_craft(tmp_path / "m.safetensors", {}, 0, raw=raw))


def test_bad_metadata(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="__metadata__"):
        read_header(_craft(tmp_path / "m.safetensors", {"__metadata__": {"a": 1}}, 0))


def test_name_label_used_in_messages(tmp_path: Path) -> None:
    path = tmp_path / "blob-abc"
    path.write_bytes(b"\x01")
    with pytest.raises(IntegrityError, match="^model-00001-of-00002.safetensors:"):
        read_header(path, name="model-00001-of-00002.safetensors")
