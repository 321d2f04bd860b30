"""Reopen a GGUF file and check its structure against what was meant to be written.

Bounds come first: the header's tensor and key counts are checked against the file
size before gguf's reader walks them (crafted files have made readers hang or
over-allocate), and every tensor's byte range must lie inside the file and match
its type and shape.

Example::

    summary = inspect_gguf(path, expected={"blk.0.attn_q.weight": (GGMLQuantizationType.TQ2_0, (256, 256))})
    summary.bits_per_weight
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from pipeline.core.errors import IntegrityError
from pipeline.formats.gguf.keys import General
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.types import GGMLType, block_geometry, ggml_type_from_id

__all__ = ["GGUFSummary", "inspect_gguf", "read_metadata"]

_HEADER = struct.Struct("<IIQQ")  # magic, version, tensor count, kv count
# Smallest possible encodings: a tensor info is name length (8) + >=1 name byte +
# n_dims (4) + >=1 dim (8) + type (4) + offset (8); a kv is key length (8) + >=1 byte +
# value type (4) + >=1 value byte.
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8
_MIN_KV_BYTES = 8 + 1 + 4 + 1


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF file holds, in numbers."""

    path: Path
    size_bytes: int
    architecture: str | None
    tensor_count: int
    types: Mapping[str, int]
    n_params: int
    tensor_bytes: int
    bits_per_weight: float
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # torch order
    tensor_types: Mapping[str, str] = field(default_factory=dict)


def _check_header(path: Path, size_bytes: int) -> None:
    with open(path, "rb") as handle:
        head = handle.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise IntegrityError(f"{path.name}: {size_bytes} bytes is too short for a GGUF header")
    magic, version, n_tensors, n_kv = _HEADER.unpack(head)
    if magic != gguf.GGUF_MAGIC:
        raise IntegrityError(f"{path.name}: magic {magic:#x} is not GGUF's {gguf.GGUF_MAGIC:#x}")
    if version not in gguf.READER_SUPPORTED_VERSIONS:
        raise IntegrityError(f"{path.name}: GGUF version {version} is not one the reader supports")
    if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > size_bytes:
        raise IntegrityError(
            f"{path.name}: header claims {n_tensors} tensors and {n_kv} keys, "
            f"more than {size_bytes} bytes can hold"
        )


def _open(path: Path) -> GGUFFile:
    size_bytes = path.stat().st_size
    _check_header(path, size_bytes)
    # GGUFFile, not gguf.GGUFReader: the latter takes ~16 s on a 262k-token vocabulary.
    try:
        return GGUFFile(path)
    except (ValueError, IndexError, KeyError, struct.error) as exc:
        raise IntegrityError(f"{path.name}: not a readable GGUF file: {exc}") from exc


def _field_value(reader: GGUFFile, key: str) -> Any:
    fld = reader.get_field(key)
    return None if fld is None else fld.contents()


def read_metadata(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of `keys` present in a GGUF file (absent keys are left out)."""
    reader = _open(Path(path))
    values = {key: _field_value(reader, key) for key in keys}
    return {key: value for key, value in values.items() if value is not None}


def _check_tensor(tensor: Any, size_bytes: int, name: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGML ne order -> torch order
    qtype = tensor.tensor_type
    block_size, type_size = block_geometry(qtype)
    if not shape or shape[-1] % block_size:
        raise IntegrityError(
            f"{name}: tensor {tensor.name!r} shape {list(shape)} does not fit {qtype.name} blocks"
        )
    expected = tensor.n_elements // block_size * type_size
    end = int(tensor.data_offset) + expected
    if tensor.n_bytes != expected or end > size_bytes or tensor.data.nbytes != expected:
        raise IntegrityError(
            f"{name}: tensor {tensor.name!r} ({qtype.name} {list(shape)}) needs {expected} bytes at offset "
            f"{tensor.data_offset}, but the file holds {tensor.data.nbytes} there "
            f"(file is {size_bytes} bytes)"
        )
    return shape


def _compare(
    expected: Mapping[str, tuple[GGMLType, tuple[int, ...]]],
    types: Mapping[str, str],
    shapes: Mapping[str, tuple[int, ...]],
    name: str,
) -> None:
    missing = sorted(set(expected) - set(types))
    extra = sorted(set(types) - set(expected))
    if missing or extra:
        raise IntegrityError(f"{name}: tensors missing {missing[:5]}, unexpected {extra[:5]}")
    for tensor_name, (qtype, shape) in expected.items():
        intended = ggml_type_from_id(int(qtype)).name
        if types[tensor_name] != intended or shapes[tensor_name] != tuple(shape):
            raise IntegrityError(
                f"{name}: tensor {tensor_name!r} is {types[tensor_name]} {list(shapes[tensor_name])}; "
                f"intended {intended} {list(shape)}"
            )


def inspect_gguf(
    path: Path,
    expected: Mapping[str, tuple[GGMLType, tuple[int, ...]]] | None = None,
) -> GGUFSummary:
    """Check a GGUF file's structure and summarise it.

    `expected` maps tensor names to (type, torch-order shape); when given, the file
    must hold exactly those tensors. Raises IntegrityError naming the first problem.
    """
    path = Path(path)
    size_bytes = path.stat().st_size
    reader = _open(path)
    types: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    n_params = tensor_bytes = 0
    for tensor in reader.tensors:
        if tensor.name in types:
            raise IntegrityError(f"{path.name}: tensor {tensor.name!r} appears twice")
        shapes[tensor.name] = _check_tensor(tensor, size_bytes, path.name)
        types[tensor.name] = tensor.tensor_type.name
        n_params += int(tensor.n_elements)
        tensor_bytes += int(tensor.n_bytes)
    if expected is not None:
        _compare(expected, types, shapes, path.name)
    arch = _field_value(reader, General.ARCHITECTURE)
    return GGUFSummary(
        path=path,
        size_bytes=size_bytes,
        architecture=arch if isinstance(arch, str) else None,
        tensor_count=len(types),
        types=dict(sorted(Counter(types.values()).items())),
        n_params=n_params,
        tensor_bytes=tensor_bytes,
        bits_per_weight=(8.0 * tensor_bytes / n_params) if n_params else 0.0,
        shapes=shapes,
        tensor_types=types,
    )
