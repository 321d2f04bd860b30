"""GGML bytes of any type a part may carry: sizes, plain encodings, and decoding back to floats.

The low-bit types a fit writes (TQ2_0, TQ1_0, Q2_0, Q1_0) have a codec each (`codecs`); the
plain types (F32, F16, BF16, Q8_0 and llama.cpp's own legacy and K-quants) are encoded here.

Example::

    raw = encode_plain(w, "Q8_0")                     # np.uint8 bytes
    values = decode_bytes(raw, "Q8_0", tuple(w.shape))  # float32, w's shape
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pipeline.formats.gguf.ggml_quantize import LLAMA_QUANT_TYPES, quantize
from pipeline.formats.gguf.types import GGMLTypeName, block_geometry
from pipeline.ternary.codecs import CODECS, FITTED_TYPES
from pipeline.ternary.codecs.base import as_numpy

if TYPE_CHECKING:
    import torch  # only to name it: these functions take torch tensors but need no torch of their own

__all__ = ["PLAIN_TYPES", "PART_TYPES", "bits_per_weight", "tensor_nbytes", "encode_plain", "decode_bytes"]

# Types a tensor is stored as without a ternary fit; the legacy and K-quants come from llama.cpp's
# own quantizer (`formats.gguf.ggml_quantize`).
PLAIN_TYPES = (GGMLTypeName.F32, GGMLTypeName.F16, GGMLTypeName.BF16, GGMLTypeName.Q8_0, *LLAMA_QUANT_TYPES)
# Types a decompose part may carry: what llama.cpp runs and a recipe may choose.
PART_TYPES = (*FITTED_TYPES, *PLAIN_TYPES)
U8Array = npt.NDArray[np.uint8]


def _qtype(ggml_type: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType[ggml_type]
    except KeyError as exc:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from exc


def _geometry(ggml_type: str) -> tuple[int, int]:
    try:
        return block_geometry(ggml_type)
    except ValueError as exc:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from exc


def bits_per_weight(ggml_type: str) -> float:
    """Storage bits per weight of a ggml type (TQ2_0 2.0625, Q2_0 2.25, Q1_0 1.125, Q8_0 8.5, F16 16)."""
    block, type_bytes = _geometry(ggml_type)
    return type_bytes * 8 / block


def tensor_nbytes(ggml_type: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of torch ``shape`` takes in ``ggml_type``; ValueError if rows do not fit its blocks."""
    block, type_bytes = _geometry(ggml_type)
    cols = shape[-1] if shape else 1
    if cols % block != 0:
        raise ValueError(f"row length {cols} is not a multiple of the {ggml_type} block size {block}")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block * type_bytes


def encode_plain(values: npt.ArrayLike | torch.Tensor, ggml_type: str,
                 importance: npt.ArrayLike | None = None) -> U8Array:
    """Raw little-endian bytes of a float tensor in F32, F16, BF16, Q8_0 or a llama.cpp quant, flattened.

    BF16 and Q8_0 use gguf-py's quantizers (round-to-nearest-even BF16; llama.cpp's Q8_0
    reference); Q4_0, Q5_0 and the K-quants llama.cpp's own, weighted by ``importance`` (one
    weight per column) when given. Raises ValueError for other types, for values that overflow
    F16 (the caller names the tensor) and for rows that are not whole blocks.
    """
    arr = np.ascontiguousarray(as_numpy(values, float32=True), dtype=np.float32)
    if ggml_type == GGMLTypeName.F32:
        out = arr.astype("<f4")
    elif ggml_type == GGMLTypeName.F16:
        with np.errstate(over="ignore"):
            out = arr.astype("<f2")
        if not np.all(np.isfinite(out) | ~np.isfinite(arr)):
            raise ValueError(f"values up to {float(np.abs(arr).max()):g} overflow F16 (max 65504)")
    elif ggml_type in LLAMA_QUANT_TYPES:
        out = quantize(arr if arr.ndim else arr.reshape(1), ggml_type, importance)
    elif ggml_type in (GGMLTypeName.BF16, GGMLTypeName.Q8_0):
        if ggml_type == GGMLTypeName.Q8_0 and arr.shape and arr.shape[-1] % 32 != 0:
            raise ValueError(f"row length {arr.shape[-1]} is not a multiple of the Q8_0 block size 32")
        out = gguf_quants.quantize(arr, _qtype(ggml_type))
    else:
        raise ValueError(f"{ggml_type!r} is not a plain type; expected one of {PLAIN_TYPES}")
    return np.ascontiguousarray(out).view(np.uint8).reshape(-1)


def decode_bytes(raw: npt.ArrayLike, ggml_type: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Float32 values of raw bytes in any supported type, reshaped to torch ``shape``."""
    data = np.asarray(raw, dtype=np.uint8)
    if ggml_type == GGMLTypeName.F32:
        out = data.view("<f4").astype(np.float32)
    elif ggml_type == GGMLTypeName.F16:
        out = data.view("<f2").astype(np.float32)
    elif ggml_type in (GGMLTypeName.Q2_0, GGMLTypeName.Q1_0):  # gguf-py has no maths for these
        out = CODECS[ggml_type].dequantize(data)
    else:
        out = gguf_quants.dequantize(data.reshape(-1), _qtype(ggml_type)).astype(np.float32)
    return out.reshape(shape)
