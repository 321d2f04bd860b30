"""Byte-exact llama.cpp layouts of the Bonsai types Q2_0 and Q1_0 (``ggml-common.h``, ``ggml-quants.c``).

- Q2_0 (ggml type 42), 64 weights in 18 bytes: ``d`` (little-endian fp16) first, then
  ``qs[16]``. Element ``j`` is the 2-bit code ``c`` at bits ``2 * (j % 4)`` of ``qs[j // 4]``
  (sequential, not bit planes as in TQ2_0) and decodes to ``(c - 1) * d``: codes 0..3 are
  -1, 0, +1, +2 times ``d``. Here a Q2_0 "code" is that level ``q = c - 1`` in {-1, 0, 1, 2}.
- Q1_0 (ggml type 41), 128 weights in 18 bytes: ``d`` first, then ``qs[16]`` of sign bits.
  Element ``j`` is bit ``j % 8`` of ``qs[j // 8]``: 1 decodes to ``+d``, 0 to ``-d``. Here its
  codes are those signs, -1 or +1.

Scales are any finite fp16 value, negative included (a negative Q2_0 scale mirrors the grid).
Decoding multiplies a small integer by an fp16 value, which float32 holds exactly, so
`dequantize_q2_0` / `dequantize_q1_0` give llama.cpp's values bit for bit.

Example::

    raw = pack_q2_0(codes, scales)            # np.uint8 [n_blocks * 18]
    codes2, scales2 = unpack_q2_0(raw)        # identical to the inputs
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import BONSAI_TYPES

if TYPE_CHECKING:
    import torch  # only to name it: a value cannot be a tensor unless torch is loaded

__all__ = [
    "as_numpy",
    "QK2_0",
    "QK1_0",
    "pack_q2_0",
    "unpack_q2_0",
    "pack_q1_0",
    "unpack_q1_0",
    "dequantize_q2_0",
    "dequantize_q1_0",
]

QK2_0 = BONSAI_TYPES["Q2_0"].block_size
QK1_0 = BONSAI_TYPES["Q1_0"].block_size
_Q2_BYTES = BONSAI_TYPES["Q2_0"].type_size
_Q1_BYTES = BONSAI_TYPES["Q1_0"].type_size
_Q2_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_Q1_SHIFTS = np.arange(8, dtype=np.uint8)

U8Array = npt.NDArray[np.uint8]


def as_numpy(values: npt.ArrayLike | torch.Tensor, *, float32: bool = False) -> npt.NDArray[np.generic]:
    """A torch tensor (floating ones as float32 when ``float32``) or anything array-like as numpy.
    A value cannot be a tensor unless torch is loaded, so the packers never load it."""
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(values, torch_module.Tensor):
        tensor = values.detach()
        if float32 and tensor.is_floating_point():
            tensor = tensor.to(torch_module.float32)
        return np.asarray(tensor.cpu().numpy())
    return np.asarray(values)


def _scale_bytes(scales: npt.ArrayLike | torch.Tensor, n_blocks: int) -> U8Array:
    """Scales as little-endian fp16 bytes [n_blocks, 2]; ValueError unless finite in fp16."""
    s = as_numpy(scales).reshape(-1)
    if s.shape[0] != n_blocks:
        raise ValueError(f"{n_blocks} blocks of codes but {s.shape[0]} scales")
    with np.errstate(over="ignore", invalid="ignore"):
        s16 = s.astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise ValueError("a scale is not finite in fp16 (|d| > 65504 or NaN)")
    return s16.astype("<f2").view(np.uint8).reshape(-1, 2)


def _unpack_scales(blocks: U8Array) -> npt.NDArray[np.float32]:
    return blocks[:, :2].copy().view("<f2").astype(np.float32).reshape(-1)


def pack_q2_0(codes: npt.ArrayLike | torch.Tensor, scales: npt.ArrayLike | torch.Tensor) -> U8Array:
    """Q2_0 bytes ``[n_blocks * 18]`` for levels ``[n_blocks, 64]`` (any n*64 shape) in {-1, 0, 1, 2}.

    ``scales``: ``[n_blocks]``, fp16-exact (other values are rounded to nearest). Raises
    ValueError for a level outside {-1, 0, 1, 2}, a count mismatch or a scale not finite in fp16.
    """
    c = as_numpy(codes).astype(np.int16).reshape(-1, QK2_0)
    if c.size and (c.min() < -1 or c.max() > 2):
        raise ValueError("Q2_0 levels must lie in {-1, 0, 1, 2}")
    d = _scale_bytes(scales, c.shape[0])
    q = (c.astype(np.int16) + 1).astype(np.uint8).reshape(-1, QK2_0 // 4, 4)
    qs = np.bitwise_or.reduce(q << _Q2_SHIFTS, axis=2)
    return np.concatenate([d, qs], axis=1).reshape(-1)


def unpack_q2_0(raw: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """Inverse of `pack_q2_0`: int8 levels ``[n_blocks, 64]`` in {-1, 0, 1, 2} and float32 scales."""
    blocks = _blocks(raw, _Q2_BYTES, "Q2_0")
    qs = blocks[:, 2:, None] >> _Q2_SHIFTS
    codes = (qs & 3).reshape(-1, QK2_0).astype(np.int8) - np.int8(1)
    return codes, _unpack_scales(blocks)


def pack_q1_0(codes: npt.ArrayLike | torch.Tensor, scales: npt.ArrayLike | torch.Tensor) -> U8Array:
    """Q1_0 bytes ``[n_blocks * 18]`` for signs ``[n_blocks, 128]`` (any n*128 shape) in {-1, +1}.

    Raises ValueError for a code other than -1 or +1, a count mismatch or a bad scale.
    """
    c = as_numpy(codes).astype(np.int16).reshape(-1, QK1_0)
    if c.size and not np.all((c == 1) | (c == -1)):
        raise ValueError("Q1_0 codes must be -1 or +1")
    d = _scale_bytes(scales, c.shape[0])
    bits = (c > 0).astype(np.uint8).reshape(-1, QK1_0 // 8, 8)
    qs = np.bitwise_or.reduce(bits << _Q1_SHIFTS, axis=2)
    return np.concatenate([d, qs], axis=1).reshape(-1)


def unpack_q1_0(raw: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
    """Inverse of `pack_q1_0`: signs int8 ``[n_blocks, 128]`` in {-1, +1}, scales float32 ``[n_blocks]``."""
    blocks = _blocks(raw, _Q1_BYTES, "Q1_0")
    bits = (blocks[:, 2:, None] >> _Q1_SHIFTS) & 1
    codes = bits.reshape(-1, QK1_0).astype(np.int8) * np.int8(2) - np.int8(1)
    return codes, _unpack_scales(blocks)


def _blocks(raw: npt.ArrayLike, block_bytes: int, name: str) -> U8Array:
    data = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if data.size % block_bytes:
        raise ValueError(f"{data.size} bytes are not whole {name} blocks of {block_bytes} bytes")
    return data.reshape(-1, block_bytes)


def dequantize_q2_0(raw: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """llama.cpp's ``dequantize_row_q2_0``: float32 ``[n_blocks * 64]``, ``(c - 1) * d`` per element."""
    codes, scales = unpack_q2_0(raw)
    out: npt.NDArray[np.float32] = (codes.astype(np.float32) * scales[:, None]).reshape(-1)
    return out


def dequantize_q1_0(raw: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """llama.cpp's ``dequantize_row_q1_0``: float32 ``[n_blocks * 128]``, ``+d`` for bit 1, ``-d`` for 0."""
    codes, scales = unpack_q1_0(raw)
    out: npt.NDArray[np.float32] = (codes.astype(np.float32) * scales[:, None]).reshape(-1)
    return out
