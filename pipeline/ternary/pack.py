"""Byte-exact llama.cpp block layouts for ternary codes, plus raw bytes for plain tensor types.

Layouts (``ggml-common.h``; QK_K = 256 weights per block, ``d`` a little-endian fp16):

- TQ2_0 (ggml type 35), 66 bytes: ``qs[64]`` then ``d``. Code ``q = t + 1`` (0, 1, 2) is a
  2-bit field: element ``n`` lives in byte ``32 * (n // 128) + n % 32`` at bit shift
  ``2 * ((n % 128) // 32)`` (bit planes, not sequential).
- TQ1_0 (ggml type 34), 54 bytes: ``qs[48]``, ``qh[4]``, then ``d``. ``qs[0:32]`` packs
  elements 0..159 five per byte (byte ``m`` holds ``m + 32*i``, i = 0..4, the first as the
  most significant trit), ``qs[32:48]`` elements 160..239 likewise with stride 16, ``qh[j]``
  elements ``240 + j + 4*i`` (i = 0..3) with one extra ×3. Each base-3 number ``v < 243`` is
  stored as ``ceil(v * 256 / 243)`` so a trit is read back as ``((byte * 3^i mod 256) * 3) >> 8``.

Example::

    raw = pack_tq2_0(codes, scales)          # np.uint8 [n_blocks * 66]
    codes2, scales2 = unpack_tq2_0(raw)      # identical to the inputs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pipeline.formats.gguf.ggml_quantize import LLAMA_QUANT_TYPES, quantize
from pipeline.formats.gguf.types import block_geometry
from pipeline.ternary import pack_bonsai
from pipeline.ternary.pack_bonsai import as_numpy

if TYPE_CHECKING:
    import torch  # only to name it: these functions take torch tensors but need no torch of their own

__all__ = [
    "QK_K",
    "TERNARY_TYPES",
    "BONSAI_TYPES",
    "PLAIN_TYPES",
    "PART_TYPES",
    "bits_per_weight",
    "tensor_nbytes",
    "pack_tq2_0",
    "unpack_tq2_0",
    "pack_tq1_0",
    "unpack_tq1_0",
    "pack_ternary",
    "unpack_ternary",
    "encode_plain",
    "decode_bytes",
]

QK_K = 256
TERNARY_TYPES = ("TQ2_0", "TQ1_0")
BONSAI_TYPES = ("Q2_0", "Q1_0")  # llama.cpp's Bonsai types: `pack_bonsai`
# Types a tensor is stored as without a ternary fit; the legacy and K-quants come from llama.cpp's
# own quantizer (`formats.gguf.ggml_quantize`).
PLAIN_TYPES = ("F32", "F16", "BF16", "Q8_0", *LLAMA_QUANT_TYPES)
# Types a decompose part may carry: what llama.cpp runs and a recipe may choose.
PART_TYPES = (*TERNARY_TYPES, *BONSAI_TYPES, *PLAIN_TYPES)
_TQ2_BYTES = 66
_TQ1_BYTES = 54
_POW5 = np.array([81, 27, 9, 3, 1], dtype=np.uint16)
_POW4 = np.array([81, 27, 9, 3], dtype=np.uint16)  # qh: the first trit is shifted up one more place
_READ5 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_READ4 = np.array([1, 3, 9, 27], dtype=np.uint8)

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


def _as_blocks(codes: npt.ArrayLike | torch.Tensor, scales: npt.ArrayLike | torch.Tensor,
               ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Codes as uint8 ``t + 1`` [n_blocks, 256] and scales as fp16 bytes [n_blocks, 2]."""
    c = as_numpy(codes)
    s = as_numpy(scales)
    c = c.reshape(-1, QK_K)
    s = s.reshape(-1)
    if s.shape[0] != c.shape[0]:
        raise ValueError(f"{c.shape[0]} blocks of codes but {s.shape[0]} scales")
    if c.size and (c.min() < -1 or c.max() > 1):
        raise ValueError("codes must lie in {-1, 0, +1}")
    with np.errstate(over="ignore"):
        s16 = s.astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise ValueError("a scale is not finite in fp16 (|d| > 65504 or NaN)")
    q = (c.astype(np.int16) + 1).astype(np.uint8)
    return q, s16.astype("<f2").view(np.uint8).reshape(-1, 2)


def pack_tq2_0(codes: npt.ArrayLike | torch.Tensor, scales: npt.ArrayLike | torch.Tensor) -> U8Array:
    """TQ2_0 bytes ``[n_blocks * 66]`` for codes ``[n_blocks, 256]`` (any n*256 shape), scales [n_blocks]."""
    q, d = _as_blocks(codes, scales)
    planes = q.reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qs = np.bitwise_or.reduce(planes, axis=2).reshape(-1, 64)
    return np.concatenate([qs, d], axis=1).reshape(-1)


def unpack_tq2_0(raw: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """Inverse of `pack_tq2_0`: codes int8 ``[n_blocks, 256]`` and scales float32 ``[n_blocks]``."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, _TQ2_BYTES)
    qs = blocks[:, :64].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (qs & 3).reshape(-1, QK_K).astype(np.int8) - 1
    scales = blocks[:, 64:].copy().view("<f2").astype(np.float32).reshape(-1)
    return codes, scales


def _base3(q: npt.NDArray[np.uint8], powers: npt.NDArray[np.uint16]) -> npt.NDArray[np.uint8]:
    """Sum over axis -2 of trits × powers, then the ceil(v * 256 / 243) encoding."""
    v = (q.astype(np.uint16) * powers.reshape(-1, 1)).sum(axis=-2, dtype=np.uint16)
    out: npt.NDArray[np.uint8] = ((v * 256 + 242) // 243).astype(np.uint8)
    return out


def pack_tq1_0(codes: npt.ArrayLike | torch.Tensor, scales: npt.ArrayLike | torch.Tensor) -> U8Array:
    """TQ1_0 bytes, ``[n_blocks * 54]``, for codes ``[n_blocks, 256]`` and scales ``[n_blocks]``."""
    q, d = _as_blocks(codes, scales)
    n = q.shape[0]
    qs0 = _base3(q[:, :160].reshape(n, 5, 32), _POW5)
    qs1 = _base3(q[:, 160:240].reshape(n, 5, 16), _POW5)
    qh = _base3(q[:, 240:].reshape(n, 4, 4), _POW4)
    return np.concatenate([qs0, qs1, qh, d], axis=1).reshape(-1)


def _read_trits(b: npt.NDArray[np.uint8], powers: npt.NDArray[np.uint8]) -> npt.NDArray[np.int8]:
    """Trits of encoded bytes ``b`` [n, m] as [n, len(powers), m], most significant first."""
    shifted = b[:, None, :] * powers.reshape(1, -1, 1)  # uint8 wrap-around is the mod 256
    return ((shifted.astype(np.uint16) * 3) >> 8).astype(np.int8)


def unpack_tq1_0(raw: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """Inverse of `pack_tq1_0`: codes int8 ``[n_blocks, 256]`` and scales float32 ``[n_blocks]``."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, _TQ1_BYTES)
    n = blocks.shape[0]
    parts = [
        _read_trits(blocks[:, :32], _READ5).reshape(n, 160),
        _read_trits(blocks[:, 32:48], _READ5).reshape(n, 80),
        _read_trits(blocks[:, 48:52], _READ4).reshape(n, 16),
    ]
    codes = np.concatenate(parts, axis=1) - np.int8(1)
    scales = blocks[:, 52:].copy().view("<f2").astype(np.float32).reshape(-1)
    return codes, scales


def pack_ternary(ggml_type: str, codes: npt.ArrayLike | torch.Tensor,
                 scales: npt.ArrayLike | torch.Tensor) -> U8Array:
    """`pack_tq2_0`, `pack_tq1_0`, `pack_bonsai.pack_q2_0` or `pack_bonsai.pack_q1_0` by type name."""
    if ggml_type == "TQ2_0":
        return pack_tq2_0(codes, scales)
    if ggml_type == "TQ1_0":
        return pack_tq1_0(codes, scales)
    if ggml_type == "Q2_0":
        return pack_bonsai.pack_q2_0(codes, scales)
    if ggml_type == "Q1_0":
        return pack_bonsai.pack_q1_0(codes, scales)
    raise ValueError(f"{ggml_type!r} is not a ternary type; expected one of {TERNARY_TYPES + BONSAI_TYPES}")


def unpack_ternary(
    ggml_type: str, raw: npt.ArrayLike
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """`unpack_tq2_0`, `unpack_tq1_0`, `pack_bonsai.unpack_q2_0` or `pack_bonsai.unpack_q1_0` by type name."""
    if ggml_type == "TQ2_0":
        return unpack_tq2_0(raw)
    if ggml_type == "TQ1_0":
        return unpack_tq1_0(raw)
    if ggml_type == "Q2_0":
        return pack_bonsai.unpack_q2_0(raw)
    if ggml_type == "Q1_0":
        return pack_bonsai.unpack_q1_0(raw)
    raise ValueError(f"{ggml_type!r} is not a ternary type; expected one of {TERNARY_TYPES + BONSAI_TYPES}")


def encode_plain(values: npt.ArrayLike | torch.Tensor, ggml_type: str,
                 importance: npt.ArrayLike | None = None) -> U8Array:
    """Raw little-endian bytes of a float tensor in F32, F16, BF16, Q8_0 or a llama.cpp quant, flattened.

    BF16 and Q8_0 use gguf-py's quantizers (round-to-nearest-even BF16; llama.cpp's Q8_0
    reference); Q4_0, Q5_0 and the K-quants llama.cpp's own, weighted by ``importance`` (one
    weight per column) when given. Raises ValueError for other types, for values that overflow
    F16 (the caller names the tensor) and for rows that are not whole blocks.
    """
    arr = np.ascontiguousarray(as_numpy(values, float32=True), dtype=np.float32)
    if ggml_type == "F32":
        out = arr.astype("<f4")
    elif ggml_type == "F16":
        with np.errstate(over="ignore"):
            out = arr.astype("<f2")
        if not np.all(np.isfinite(out) | ~np.isfinite(arr)):
            raise ValueError(f"values up to {float(np.abs(arr).max()):g} overflow F16 (max 65504)")
    elif ggml_type in LLAMA_QUANT_TYPES:
        out = quantize(arr if arr.ndim else arr.reshape(1), ggml_type, importance)
    elif ggml_type in ("BF16", "Q8_0"):
        if ggml_type == "Q8_0" and arr.shape and arr.shape[-1] % 32 != 0:
            raise ValueError(f"row length {arr.shape[-1]} is not a multiple of the Q8_0 block size 32")
        out = gguf_quants.quantize(arr, _qtype(ggml_type))
    else:
        raise ValueError(f"{ggml_type!r} is not a plain type; expected one of {PLAIN_TYPES}")
    return np.ascontiguousarray(out).view(np.uint8).reshape(-1)


def decode_bytes(raw: npt.ArrayLike, ggml_type: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Float32 values of raw bytes in any supported type, reshaped to torch ``shape``."""
    data = np.asarray(raw, dtype=np.uint8)
    if ggml_type == "F32":
        out = data.view("<f4").astype(np.float32)
    elif ggml_type == "F16":
        out = data.view("<f2").astype(np.float32)
    elif ggml_type == "Q2_0":  # gguf-py has no maths for the Bonsai types
        out = pack_bonsai.dequantize_q2_0(data)
    elif ggml_type == "Q1_0":
        out = pack_bonsai.dequantize_q1_0(data)
    else:
        out = gguf_quants.dequantize(data.reshape(-1), _qtype(ggml_type)).astype(np.float32)
    return out.reshape(shape)
