"""Read and validate a safetensors header without touching tensor data.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the
header), an optional ``__metadata__`` string map, then the tensor bytes.

Everything is checked before a caller trusts an offset: header length against a cap and the
file size, JSON shape, duplicate keys, dtype whitelist, ``prod(shape) * itemsize == end - begin``,
tensors covering the data region in order with no gaps or overlaps, and the last tensor
ending exactly at the end of the file.

Usage::

    header = read_header(Path("model.safetensors"))
    for tensor in header.tensors:
        print(tensor.name, tensor.dtype, tensor.shape, tensor.numel)
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, IntegrityError

__all__ = [
    "DTYPE_SIZE_BYTES",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "parse_header",
    "read_header",
]

# The official library refuses headers above 100 MB; a larger one is an attack, not a model.
MAX_HEADER_BYTES = 100 * 1000 * 1000
_LENGTH_PREFIX_BYTES = 8

# Whole-byte dtypes the safetensors format defines; sub-byte types (F4, F6_*) are left out
# on purpose: they only appear in already-quantized checkpoints.
DTYPE_SIZE_BYTES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `begin`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.shape)

    @property
    def size_bytes(self) -> int:
        """Bytes of tensor data."""
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: tensors in file order, the free-form metadata, and the sizes."""

    name: str
    header_size_bytes: int
    file_size_bytes: int
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str]

    @property
    def data_start(self) -> int:
        """Absolute offset of the first tensor byte."""
        return _LENGTH_PREFIX_BYTES + self.header_size_bytes


def read_header(
    path: Path, *, name: str | None = None, max_header_bytes: int = MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Read and validate the header of `path`; reads 8 + N bytes, never the tensor data.

    `name` labels messages (defaults to the file name). Raises IntegrityError for a header or
    layout that is corrupt, truncated or inconsistent, InputError for an unsupported dtype.
    """
    label = name or path.name
    with open(path, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(_LENGTH_PREFIX_BYTES)
        if len(prefix) < _LENGTH_PREFIX_BYTES:
            raise IntegrityError(
                f"{label}: {file_size} bytes is too short for a safetensors file "
                "(it needs an 8-byte header length)"
            )
        (header_size,) = struct.unpack("<Q", prefix)
        _check_header_size(label, header_size, file_size, max_header_bytes)
        raw = handle.read(header_size)
    if len(raw) != header_size:
        raise IntegrityError(f"{label}: header claims {header_size} bytes but only {len(raw)} could be read")
    return parse_header(raw, file_size_bytes=file_size, name=label)


def _check_header_size(label: str, header_size: int, file_size: int, max_header_bytes: int) -> None:
    if header_size > max_header_bytes:
        raise IntegrityError(
            f"{label}: header length {header_size} bytes exceeds the {max_header_bytes}-byte cap "
            "(corrupt or hostile file; not a safetensors file?)"
        )
    if header_size < 2:
        raise IntegrityError(f"{label}: header length {header_size} is too small to hold a JSON object")
    if _LENGTH_PREFIX_BYTES + header_size > file_size:
        raise IntegrityError(
            f"{label}: header claims {header_size} bytes but the file has only {file_size} bytes (truncated?)"
        )


def parse_header(raw: bytes, *, file_size_bytes: int, name: str) -> SafetensorsHeader:
    """Validate the JSON header bytes `raw` of a file of `file_size_bytes`; see `read_header`."""
    document = _decode_json(raw, name)
    data_start = _LENGTH_PREFIX_BYTES + len(raw)
    metadata = _metadata(document.pop("__metadata__", None), name)
    tensors = [_tensor_entry(name, key, value, data_start) for key, value in document.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    _check_coverage(name, tensors, data_start, file_size_bytes)
    return SafetensorsHeader(
        name=name,
        header_size_bytes=len(raw),
        file_size_bytes=file_size_bytes,
        tensors=tuple(tensors),
        metadata=metadata,
    )


def _decode_json(raw: bytes, name: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise IntegrityError(f"{name}: header names {key!r} twice (ambiguous; refusing)")
            result[key] = value
        return result

    if not raw.lstrip().startswith(b"{"):
        raise IntegrityError(f"{name}: header does not start with a JSON object (not a safetensors file?)")
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise IntegrityError(f"{name}: header is not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise IntegrityError(f"{name}: header is not a JSON object")
    return document


def _metadata(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise IntegrityError(f"{name}: __metadata__ must map strings to strings")
    return value


def _tensor_entry(name: str, key: str, value: Any, data_start: int) -> TensorInfo:
    where = f"{name}: tensor {key!r}"
    if not isinstance(value, dict):
        raise IntegrityError(f"{where}: header entry is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str):
        raise IntegrityError(f"{where}: missing or non-string dtype")
    if dtype not in DTYPE_SIZE_BYTES:
        raise InputError(
            f"{where}: dtype {dtype!r} is not supported (supported: {', '.join(DTYPE_SIZE_BYTES)})"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise IntegrityError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise IntegrityError(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    expected = math.prod(shape) * DTYPE_SIZE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise IntegrityError(
            f"{where}: shape {shape} x {dtype} needs {expected} bytes but data_offsets {offsets} "
            f"span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(key, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _is_int(value: Any) -> bool:
    # JSON true/false decode to bool, a subclass of int: not a dimension.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_coverage(name: str, tensors: list[TensorInfo], data_start: int, file_size: int) -> None:
    """Tensors, sorted by offset, must tile [data_start, file_size) exactly."""
    cursor = data_start
    previous: TensorInfo | None = None
    for tensor in tensors:
        if tensor.begin < cursor:
            assert previous is not None
            raise IntegrityError(
                f"{name}: tensor {tensor.name!r} bytes [{tensor.begin}, {tensor.end}) overlap tensor "
                f"{previous.name!r} bytes [{previous.begin}, {previous.end})"
            )
        if tensor.begin > cursor:
            after = f"after tensor {previous.name!r}" if previous else "after the header"
            raise IntegrityError(
                f"{name}: {tensor.begin - cursor} unclaimed bytes at [{cursor}, {tensor.begin}) {after}, "
                f"before tensor {tensor.name!r}"
            )
        if tensor.end > file_size:
            raise IntegrityError(
                f"{name}: tensor {tensor.name!r} ends at byte {tensor.end} "
                f"but the file has {file_size} bytes (truncated?)"
            )
        # A zero-size tensor does not move the cursor, so later ones are not flagged as overlapping it.
        if tensor.end > tensor.begin:
            previous = tensor
        cursor = tensor.end
    if cursor != file_size:
        raise IntegrityError(
            f"{name}: tensors end at byte {cursor} but the file has {file_size} bytes "
            f"({file_size - cursor} trailing bytes not described by the header)"
        )
