"""Streaming GGUF writer: metadata and tensor infos first, then tensor data one at a time.

Tensor data comes from a provider per tensor (`TensorToWrite.load`), called only when
that tensor is written, so peak memory is about one tensor whatever the model size; or,
when the bytes already sit in a file (`TensorToWrite.file_range`), it is copied file to
file in the kernel (``copy_file_range``) without passing through this process at all.
Tensors arrive as raw bytes already in GGML block layout (pre-quantized TQ2_0,
TQ1_0, Q8_0) or as plain F16/F32 arrays. The file is written under a temporary name
next to `dest` and renamed into place only when complete.

Example::

    meta = llama_metadata(config, file_type=gguf.LlamaFileType.MOSTLY_TQ2_0)
    meta.update(vocab.metadata())
    write_gguf(workdir / "model.gguf", "llama", meta, [TensorToWrite(name, qtype, shape, loader), ...])
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np

from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.files import atomic_path
from pipeline.formats.gguf.keys import LLM, Attention, General, Rope, arch_key
from pipeline.formats.gguf.types import (
    BONSAI_TYPES,
    FileType,
    GGMLType,
    GGMLTypeName,
    block_geometry,
    file_type_of,
    ggml_type,
)
from pipeline.formats.rawio import copy_range

__all__ = [
    "TensorToWrite",
    "Typed",
    "WrittenGGUF",
    "tensor_nbytes",
    "file_type_for",
    "llama_metadata",
    "llama3_rope_factors",
    "write_gguf",
]

# Which file_type to advertise, by the lowest-precision tensor type present (the
# "mostly" in llama.cpp's names): binary and ternary win over Q8_0 over F16 over F32.
# Rope kinds written as-is; "llama3" adds the rope_freqs tensor (see llama3_rope_factors).
_ROPE_KINDS = frozenset({"default", "linear", "llama3"})

_FILE_TYPE_BY_TYPE: tuple[tuple[GGMLType, FileType], ...] = (
    (ggml_type(GGMLTypeName.Q1_0), file_type_of(BONSAI_TYPES[GGMLTypeName.Q1_0].file_type_name)),
    (gguf.GGMLQuantizationType.TQ1_0, gguf.LlamaFileType.MOSTLY_TQ1_0),
    (gguf.GGMLQuantizationType.TQ2_0, gguf.LlamaFileType.MOSTLY_TQ2_0),
    (ggml_type(GGMLTypeName.Q2_0), file_type_of(BONSAI_TYPES[GGMLTypeName.Q2_0].file_type_name)),
    (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
)


@dataclass(frozen=True)
class TensorToWrite:
    """One tensor to write. `shape` is torch order [rows, cols]; `load` returns its bytes.

    `load()` returns a numpy array whose raw bytes are the tensor in GGML layout for
    `ggml_type` (uint8 for block types; float16/float32 arrays work for F16/F32).
    `file_range`, when given, is (path, byte offset) of exactly those bytes in an existing
    file; they are then copied from there and `load` is not called.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray[Any, Any]]
    file_range: tuple[Path, int] | None = None


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type, when the inferred one is wrong."""

    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


@dataclass(frozen=True)
class WrittenGGUF:
    """What `write_gguf` wrote."""

    path: Path
    size_bytes: int
    tensor_count: int
    types: Mapping[str, int]


def tensor_nbytes(ggml_type: GGMLType, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `shape` (torch order) in `ggml_type`; InputError if rows do not fit blocks."""
    block_size, type_size = block_geometry(ggml_type)
    if not shape or shape[-1] % block_size:
        raise InputError(
            f"shape {list(shape)} cannot be stored as {ggml_type.name}: the last dimension must be a "
            f"multiple of its block size {block_size}"
        )
    n_elements = int(np.prod(shape, dtype=np.int64))
    return n_elements // block_size * type_size


def file_type_for(types: Iterable[GGMLType]) -> FileType:
    """The `general.file_type` describing a file holding these tensor types."""
    present = set(types)
    for qtype, file_type in _FILE_TYPE_BY_TYPE:
        if qtype in present:
            return file_type
    raise InputError(f"no file type describes tensor types {sorted(t.name for t in present)}")


_MAX_COUNT = 2**32 - 1  # GGUF stores the hyperparameter counts as uint32
_MAX_HEAD_DIM = 1 << 16  # real models use 64..512; rope factors allocate head_dim / 2 floats


def _config_number(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A positive finite number from config.json; InputError naming the key otherwise."""
    value = config.get(key, default)
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
        raise InputError(f"config.json key {key!r} is {value!r:.80}; expected a positive number")
    return value


def _config_count(config: Mapping[str, Any], key: str, default: Any = None, limit: int = _MAX_COUNT) -> int:
    """A positive integer (an integral float is accepted) up to `limit`; InputError otherwise."""
    value = _config_number(config, key, default)
    if value != int(value) or value > limit:
        raise InputError(f"config.json key {key!r} is {value!r:.80}; expected a positive integer <= {limit}")
    return int(value)


def _head_dim(config: Mapping[str, Any]) -> int:
    """config.json's head_dim, or hidden_size // num_attention_heads as transformers computes it."""
    n_head = _config_count(config, "num_attention_heads")
    if config.get("head_dim"):
        return _config_count(config, "head_dim", limit=_MAX_HEAD_DIM)
    head_dim = _config_count(config, "hidden_size") // n_head
    if not 0 < head_dim <= _MAX_HEAD_DIM:
        raise InputError(
            f"config.json hidden_size / num_attention_heads gives head_dim {head_dim}; "
            f"expected 1..{_MAX_HEAD_DIM}"
        )
    return head_dim


def llama_metadata(
    config: Mapping[str, Any], file_type: FileType, arch: str = "llama"
) -> dict[str, Any]:
    """`arch`'s hyperparameter keys from an HF config.json, as llama.cpp's loader expects them.

    The Llama family's keys serve every architecture in `names.ARCH_SPECS` (llama, qwen2,
    qwen3, bitnet read the same ones; head_dim goes to key/value length, so Qwen3's
    head_dim != hidden / heads is kept). Raises InputError for missing hyperparameters or a
    rope scaling Bonsai does not write.
    """
    n_head = _config_count(config, "num_attention_heads")
    hidden = _config_count(config, "hidden_size")
    head_dim = _head_dim(config)
    meta: dict[str, Any] = {
        arch_key(LLM.VOCAB_SIZE, arch): _config_count(config, "vocab_size"),
        arch_key(LLM.CONTEXT_LENGTH, arch): _config_count(config, "max_position_embeddings"),
        arch_key(LLM.EMBEDDING_LENGTH, arch): hidden,
        arch_key(LLM.BLOCK_COUNT, arch): _config_count(config, "num_hidden_layers"),
        arch_key(LLM.FEED_FORWARD_LENGTH, arch): _config_count(config, "intermediate_size"),
        arch_key(Attention.HEAD_COUNT, arch): n_head,
        arch_key(Attention.HEAD_COUNT_KV, arch): _config_count(config, "num_key_value_heads", n_head),
        arch_key(Attention.LAYERNORM_RMS_EPS, arch): float(_config_number(config, "rms_norm_eps", 1e-5)),
        arch_key(Attention.KEY_LENGTH, arch): head_dim,
        arch_key(Attention.VALUE_LENGTH, arch): head_dim,
        arch_key(Rope.FREQ_BASE, arch): float(_rope_theta(config)),
        arch_key(Rope.DIMENSION_COUNT, arch): head_dim,
        General.FILE_TYPE: int(file_type),
    }
    kind, scaling = _rope_scaling(config)
    if kind == "linear":
        meta[arch_key(Rope.SCALING_TYPE, arch)] = "linear"
        meta[arch_key(Rope.SCALING_FACTOR, arch)] = float(_config_number(scaling, "factor"))
    elif kind not in _ROPE_KINDS:
        # yarn/longrope/dynamic need keys and kernels we have not checked against llama.cpp.
        raise InputError(
            f"config.json rope scaling type {kind!r} is not supported yet (supported: {sorted(_ROPE_KINDS)})"
        )
    return meta


def _rope_scaling(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(kind, parameters): transformers >= 4.56 writes `rope_parameters`, older ones `rope_scaling`."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(scaling, Mapping):
        raise InputError(f"config.json rope scaling is {scaling!r}; expected an object")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return str(kind), scaling


def _rope_theta(config: Mapping[str, Any]) -> float:
    theta = config.get("rope_theta")
    if theta is None:
        theta = _rope_scaling(config)[1].get("rope_theta", 10000.0)
    return float(_config_number({"rope_theta": theta}, "rope_theta"))


def llama3_rope_factors(config: Mapping[str, Any]) -> np.ndarray[Any, Any] | None:
    """Per-frequency divisors for Llama 3.1+ rope scaling (the `rope_freqs.weight` tensor), or None.

    Llama 3 stretches only the low frequencies: wavelengths shorter than
    original_context / high_freq_factor keep factor 1, longer than
    original_context / low_freq_factor get `factor`, and the band between blends the two.
    Returns float32 [head_dim / 2].
    """
    kind, scaling = _rope_scaling(config)
    if kind != "llama3":
        return None
    head_dim = _head_dim(config)
    factor = float(_config_number(scaling, "factor", 8.0))
    low = float(_config_number(scaling, "low_freq_factor", 1.0))
    high = float(_config_number(scaling, "high_freq_factor", 4.0))
    old_ctx = float(_config_number(scaling, "original_max_position_embeddings", 8192))
    if high <= low:
        raise InputError(f"llama3 rope scaling has high_freq_factor {high} <= low_freq_factor {low}")
    freqs = 1.0 / (_rope_theta(config) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, blended))
    return out.astype(np.float32)


def _typed(key: str, value: Any) -> Typed:
    """Infer the GGUF type: int -> uint32, float -> float32, lists by their first item."""
    if isinstance(value, Typed):
        return value
    vt = gguf.GGUFValueType
    if isinstance(value, bool):
        return Typed(value, vt.BOOL)
    if isinstance(value, int):
        return Typed(value, vt.UINT32 if 0 <= value < 2**32 else vt.INT64)
    if isinstance(value, float):
        return Typed(value, vt.FLOAT32)
    if isinstance(value, str):
        return Typed(value, vt.STRING)
    if isinstance(value, list | tuple) and value:
        item = _typed(key, value[0])
        # Int arrays (token types) are read by llama.cpp as int32.
        sub = vt.INT32 if item.vtype is vt.UINT32 else item.vtype
        return Typed(list(value), vt.ARRAY, sub)
    raise InputError(f"metadata key {key!r} has a value of type {type(value).__name__} that GGUF cannot hold")


def _check_tensors(tensors: Sequence[TensorToWrite]) -> None:
    seen: set[str] = set()
    for item in tensors:
        if item.name in seen:
            raise InputError(f"tensor {item.name!r} is given twice")
        seen.add(item.name)
        tensor_nbytes(item.ggml_type, item.shape)


def _write_data(fd: int, item: TensorToWrite) -> int:
    """Append one tensor's bytes at ``fd``; returns how many. Bytes are GGML's little-endian
    layout already and are written as they are."""
    expected = tensor_nbytes(item.ggml_type, item.shape)
    if item.file_range is not None:
        path, offset = item.file_range
        if os.path.getsize(path) < offset + expected:
            raise IntegrityError(
                f"tensor {item.name!r}: {path.name} ends before the {expected} bytes at offset {offset}"
            )
        with open(path, "rb") as source:
            copy_range(source.fileno(), offset, fd, expected)
        return expected
    data = np.ascontiguousarray(item.load())
    if data.nbytes != expected:
        raise IntegrityError(
            f"tensor {item.name!r}: provider gave {data.nbytes} bytes, but {item.ggml_type.name} "
            f"{list(item.shape)} needs {expected}"
        )
    view = data.reshape(-1).view(np.uint8).data
    while view:
        view = view[os.write(fd, view) :]
    return expected


def _pad(fd: int, pos: int, alignment: int) -> int:
    n = -pos % alignment
    if n:
        os.write(fd, bytes(n))
    return n


def write_gguf(
    dest: Path, arch: str, metadata: Mapping[str, Any], tensors: Sequence[TensorToWrite], *,
    durable: bool = True,
) -> WrittenGGUF:
    """Write a GGUF file at `dest` (must not exist), streaming one tensor at a time.

    ``durable=False`` skips flushing it to disk before the rename: for a scratch file that
    lives only while one stage runs (calibrate's source GGUF), never for an artifact.

    Metadata values are plain Python (int -> uint32, float -> float32, bool, str, lists)
    or `Typed` for anything else. Raises InputError for bad inputs (duplicate names,
    shapes that do not fit the type, existing `dest`), IntegrityError when a provider
    returns the wrong number of bytes. Nothing is left at `dest` on failure.
    """
    dest = Path(dest)
    if dest.exists():
        raise InputError(f"{dest} already exists; artifacts are never overwritten")
    _check_tensors(tensors)
    with atomic_path(dest, durable=durable) as tmp:
        _write(tmp, arch, metadata, tensors)
    types = Counter(item.ggml_type.name for item in tensors)
    return WrittenGGUF(dest, dest.stat().st_size, len(tensors), dict(sorted(types.items())))


def _write(tmp: Path, arch: str, metadata: Mapping[str, Any], tensors: Sequence[TensorToWrite]) -> None:
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        for key, value in metadata.items():
            typed = _typed(key, value)
            writer.add_key_value(key, typed.value, typed.vtype, typed.sub_type)
        for item in tensors:
            # A non-uint8 dtype with raw_dtype makes gguf take `shape` as the logical shape.
            writer.add_tensor_info(
                item.name,
                item.shape,
                np.dtype(np.float32),
                tensor_nbytes(item.ggml_type, item.shape),
                # gguf-py packs the raw type as its integer id: a type it lacks (Q2_0) works too.
                raw_dtype=cast(gguf.GGMLQuantizationType, item.ggml_type),
            )
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        # Tensor data: gguf's writer would pass every byte through numpy; append it ourselves,
        # each tensor starting on the alignment the tensor infos were computed with.
        fd = os.open(tmp, os.O_WRONLY)  # not O_APPEND: copy_file_range refuses such targets
        try:
            pos = os.lseek(fd, 0, os.SEEK_END)
            for item in tensors:
                pos += _pad(fd, pos, writer.data_alignment)
                pos += _write_data(fd, item)
            pos += _pad(fd, pos, writer.data_alignment)
        finally:
            os.close(fd)
    except BaseException:
        writer.close()
        raise
