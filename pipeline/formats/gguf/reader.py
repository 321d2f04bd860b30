"""A fast, bounds-checked GGUF reader with the parts of `gguf.GGUFReader`'s interface we use.

Why not `gguf.GGUFReader`: it builds one numpy memmap slice per string, so a 262,144-token
vocabulary (Gemma 3) takes 16 s to open on this machine kind, and every stage that reopens a
file pays it again. Here string arrays are read in one Python loop over a memoryview and
numeric arrays in one `np.frombuffer` call: the same file opens in well under a second.

Every count and length is checked against the bytes that remain before anything is
allocated (crafted GGUF files have made readers hang or over-allocate), tensor data must
lie inside the file, and tensor names must be unique. Problems raise IntegrityError.

Interface kept from gguf.GGUFReader: ``fields`` (name -> field with ``types``, ``data``
(one entry per item) and ``contents()``), ``get_field(key)``, ``tensors`` (each with
``name``, ``tensor_type``, ``shape`` (ggml order), ``n_elements``, ``n_bytes``,
``data_offset`` (absolute) and ``data`` (a read-only memory-mapped view shaped as
GGUFReader shapes it)), ``alignment`` and ``data_offset``.

Example::

    reader = GGUFFile(path)
    reader.get_field("general.architecture").contents()      # 'gemma3'
    reader.fields["tokenizer.ggml.tokens"].typed().value[:2]   # [b'<pad>', b'<eos>']
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pipeline.core.errors import IntegrityError
from pipeline.formats.gguf.types import GGMLType, block_geometry, ggml_type_from_id
from pipeline.formats.gguf.writer import Typed

__all__ = ["GGUFFile", "GGUFField", "GGUFTensor"]

_VT = gguf.GGUFValueType
# Little-endian numpy dtypes of the scalar value types.
_SCALAR_DTYPES: Mapping[_VT, str] = {
    _VT.UINT8: "<u1",
    _VT.INT8: "<i1",
    _VT.UINT16: "<u2",
    _VT.INT16: "<i2",
    _VT.UINT32: "<u4",
    _VT.INT32: "<i4",
    _VT.FLOAT32: "<f4",
    _VT.BOOL: "?",
    _VT.UINT64: "<u8",
    _VT.INT64: "<i8",
    _VT.FLOAT64: "<f8",
}
# Plain tensor types GGUFReader exposes as typed arrays; the others come as uint8 block bytes.
_PLAIN_TENSOR_DTYPES: Mapping[GGMLType, Any] = {
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}
_MAX_DIMS = 4
# The product of a tensor's non-zero dimensions, times its bytes per element (at most 8), must
# stay inside numpy's (and ggml's) int64 byte count, even when a zero dimension keeps the
# element count itself at 0.
_MAX_DIM = (2**63 - 1) // 16
_DEFAULT_ALIGNMENT = 32
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims=0, type, offset


@dataclass(frozen=True)
class GGUFField:
    """One metadata key: ``types`` is [scalar] or [ARRAY, item type]; ``value`` is kept raw.

    Raw means: ``bytes`` for a string, ``list[bytes]`` for a string array, a numpy array for a
    numeric array, a Python scalar otherwise.
    """

    name: str
    types: tuple[_VT, ...]
    value: Any

    @property
    def data(self) -> range:
        """One entry per item (GGUFReader's ``field.data`` has one index per item)."""
        return range(len(self.value)) if self.types[0] is _VT.ARRAY else range(1)

    def contents(self) -> Any:
        """The value as GGUFReader's ``contents()`` gives it: str, list of str or numbers, scalar.

        Raises IntegrityError naming the key when a string is not UTF-8 (GGUF strings must be).
        """
        try:
            if self.types[0] is _VT.ARRAY:
                if self.types[-1] is _VT.STRING:
                    return [item.decode("utf-8") for item in self.value]
                return self.value.tolist()
            if self.types[0] is _VT.STRING:
                return self.value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IntegrityError(
                f"GGUF metadata {self.name!r}: a string is not UTF-8 (byte {exc.start}: {exc.reason})"
            ) from exc
        return self.value

    def typed(self) -> Typed:
        """The value with its exact GGUF type, for the writer (strings stay bytes)."""
        if self.types[0] is _VT.ARRAY:
            items = self.value if self.types[-1] is _VT.STRING else self.value.tolist()
            return Typed(list(items), _VT.ARRAY, self.types[-1])
        return Typed(self.value, self.types[0])


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (fastest dimension first), ``data`` a read-only view."""

    name: str
    tensor_type: GGMLType
    shape: np.ndarray[Any, Any]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray[Any, Any]


class _Cursor:
    """Little-endian reads from a buffer that refuse to step past its end."""

    def __init__(self, buf: memoryview, label: str) -> None:
        self.buf, self.label, self.pos = buf, label, 0

    def take(self, n_bytes: int, what: str) -> memoryview:
        if n_bytes < 0 or n_bytes > len(self.buf) - self.pos:
            raise IntegrityError(
                f"{self.label}: {what} at byte {self.pos} needs {n_bytes} bytes but only "
                f"{len(self.buf) - self.pos} remain (truncated or corrupt GGUF)"
            )
        start = self.pos
        self.pos += n_bytes
        return self.buf[start : self.pos]

    def u32(self, what: str) -> int:
        return int(struct.unpack_from("<I", self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack_from("<Q", self.take(8, what))[0])

    def string(self, what: str) -> bytes:
        return bytes(self.take(self.u64(f"{what} length"), what))


class GGUFFile:
    """A parsed GGUF file (little-endian, version 2 or 3), tensors memory-mapped read-only."""

    def __init__(self, path: Path | str, label: str | None = None) -> None:
        self.path = Path(path)
        label = label or self.path.name
        if self.path.stat().st_size < 24:  # magic, version and the two counts
            raise IntegrityError(f"{label}: {self.path.stat().st_size} bytes is too short for a GGUF file")
        self._map = np.memmap(self.path, mode="r")
        cur = _Cursor(memoryview(self._map.data), label)
        if bytes(cur.take(4, "magic")) != b"GGUF":
            raise IntegrityError(f"{label}: not a GGUF file (bad magic)")
        version = cur.u32("version")
        if version & 0xFFFF == 0:
            raise IntegrityError(f"{label}: big-endian GGUF files are not supported")
        if version not in gguf.READER_SUPPORTED_VERSIONS:
            raise IntegrityError(f"{label}: GGUF version {version} is not supported")
        n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > len(cur.buf) - cur.pos:
            raise IntegrityError(
                f"{label}: header claims {n_kv} metadata entries and {n_tensors} tensors, more than "
                f"{len(cur.buf)} bytes can hold"
            )
        self.fields: dict[str, GGUFField] = {}
        for index in range(n_kv):
            key = cur.string(f"metadata key #{index}").decode("utf-8", "replace")
            if key in self.fields:
                raise IntegrityError(f"{label}: metadata key {key!r} appears twice")
            self.fields[key] = _read_field(cur, key)
        self.alignment = _alignment(self.fields.get(gguf.Keys.General.ALIGNMENT), label)
        infos = [_read_tensor_info(cur, index) for index in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = self._tensors(infos, label)

    def get_field(self, key: str) -> GGUFField | None:
        """The field named `key`, or None."""
        return self.fields.get(key)

    def _tensors(self, infos: list[tuple[str, list[int], int, int]], label: str) -> list[GGUFTensor]:
        tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise IntegrityError(f"{label}: tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = ggml_type_from_id(raw_type)
                block_size, type_size = block_geometry(qtype)
            except ValueError as exc:
                raise IntegrityError(f"{label}: tensor {name!r} has unknown ggml type {raw_type}") from exc
            n_elements = math.prod(dims)  # Python ints: crafted dimensions must not wrap around
            if not dims or dims[0] % block_size:
                raise IntegrityError(
                    f"{label}: tensor {name!r} ({qtype.name} {dims}) is not whole blocks of {block_size}"
                )
            n_bytes = n_elements // block_size * type_size
            start = self.data_offset + offset
            if start + n_bytes > len(self._map):
                raise IntegrityError(
                    f"{label}: tensor {name!r} ends at byte {start + n_bytes} but the file has "
                    f"{len(self._map)} bytes (truncated?)"
                )
            np_shape = tuple(reversed(dims))
            if qtype in _PLAIN_TENSOR_DTYPES:
                data = self._map[start : start + n_bytes].view(_PLAIN_TENSOR_DTYPES[qtype]).reshape(np_shape)
            else:
                byte_shape = (*np_shape[:-1], np_shape[-1] // block_size * type_size)
                data = self._map[start : start + n_bytes].reshape(byte_shape)
            tensors.append(
                GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data)
            )
        return tensors


def _read_field(cur: _Cursor, key: str) -> GGUFField:
    vtype = _value_type(cur.u32(f"type of {key!r}"), key, cur.label)
    if vtype is _VT.ARRAY:
        item_type = _value_type(cur.u32(f"item type of {key!r}"), key, cur.label)
        count = cur.u64(f"length of {key!r}")
        if item_type is _VT.STRING:
            if count * 8 > len(cur.buf) - cur.pos:
                raise IntegrityError(f"{cur.label}: {key!r} claims {count} strings, more than the file holds")
            items = [cur.string(f"item of {key!r}") for _ in range(count)]
            return GGUFField(key, (vtype, item_type), items)
        if item_type not in _SCALAR_DTYPES:
            raise IntegrityError(
                f"{cur.label}: {key!r} is an array of {item_type.name}; nested arrays are not supported"
            )
        dtype = np.dtype(_SCALAR_DTYPES[item_type])
        raw = cur.take(count * dtype.itemsize, f"items of {key!r}")
        return GGUFField(key, (vtype, item_type), np.frombuffer(raw, dtype=dtype).copy())
    if vtype is _VT.STRING:
        return GGUFField(key, (vtype,), cur.string(f"value of {key!r}"))
    dtype = np.dtype(_SCALAR_DTYPES[vtype])
    value = np.frombuffer(cur.take(dtype.itemsize, f"value of {key!r}"), dtype=dtype)[0].item()
    return GGUFField(key, (vtype,), value)


def _value_type(raw: int, key: str, label: str) -> _VT:
    try:
        return _VT(raw)
    except ValueError as exc:
        raise IntegrityError(f"{label}: metadata {key!r} has unknown value type {raw}") from exc


def _alignment(field: GGUFField | None, label: str) -> int:
    if field is None:
        return _DEFAULT_ALIGNMENT
    value = field.value
    if field.types != (_VT.UINT32,) or value == 0 or value & (value - 1):
        raise IntegrityError(f"{label}: general.alignment {value!r} is not a power-of-two uint32")
    return int(value)


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, list[int], int, int]:
    name = cur.string(f"tensor name #{index}").decode("utf-8", "replace")
    n_dims = cur.u32(f"dimension count of {name!r}")
    if n_dims > _MAX_DIMS:
        raise IntegrityError(f"{cur.label}: tensor {name!r} claims {n_dims} dimensions (at most 4)")
    dims = [cur.u64(f"dimension of {name!r}") for _ in range(n_dims)]
    if math.prod(d for d in dims if d) > _MAX_DIM:
        raise IntegrityError(f"{cur.label}: tensor {name!r} has dimensions {dims}, over ggml's int64 limits")
    raw_type = cur.u32(f"type of {name!r}")
    offset = cur.u64(f"data offset of {name!r}")
    return name, dims, raw_type, offset
