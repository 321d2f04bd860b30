"""Proof that written bytes decode to the source's values exactly: what llama.cpp computes from the
file (``(code - 1) * d``, the fp16 scale widened to float32) compared with every source value.

A conversion whose every tensor passes is lossless, so the source's own llama.cpp run can buy
nothing the weights do not already prove. The check reads the bytes written, not the fit's codes.
TQ2_0 and Q2_0 (the types ternary checkpoints land in) are decoded and compared by a compiled
loop in one pass over the bytes; other types through `pack.decode_bytes` (numpy).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.pack import decode_bytes

__all__ = ["decodes_exactly"]

_TQ2_BYTES, _TQ2_BLOCK = 66, 256  # qs[64] then the fp16 scale; byte j holds elements of 4 rows of 32
_Q2_BYTES, _Q2_BLOCK = 18, 64  # the fp16 scale then qs[16]; byte j holds elements 4j .. 4j+3


@numba.njit(cache=True, nogil=True, inline="always")
def _same(decoded: Any, bits: Any, shift: int) -> bool:  # pragma: no cover - compiled
    """Whether float32 ``decoded`` is the source value whose bits are ``bits << shift`` (16 for BF16
    bit patterns, 0 for float32's); a zero matches either sign."""
    source = np.uint32(bits) << np.uint32(shift)
    if decoded == 0:
        return bool((source & np.uint32(0x7FFFFFFF)) == 0)
    return bool(np.float32(decoded).view(np.uint32) == source)


@numba.njit(cache=True, nogil=True, parallel=True)
def _mismatches(qs: Any, scales: Any, values: Any, shift: int, rows_of_32: bool) -> int:  # pragma: no cover
    """How many values differ from what 2-bit codes ``qs[block, byte]`` times ``scales[block]`` decode
    to. ``rows_of_32``: TQ2_0's layout (byte j's four codes are elements j, j+32, j+64, j+96 of its
    half-block of 128); else Q2_0's (byte j holds elements 4j .. 4j+3)."""
    bad = 0
    for b in numba.prange(scales.shape[0]):
        d = scales[b]
        miss = 0
        for j in range(qs.shape[1]):
            for lane in range(4):
                code = (qs[b, j] >> (2 * lane)) & 3
                at = (j // 32) * 128 + lane * 32 + j % 32 if rows_of_32 else 4 * j + lane
                if not _same(np.float32(np.int32(code) - 1) * d, values[b, at], shift):
                    miss += 1
        bad += miss
    return bad


def decodes_exactly(raw: npt.NDArray[np.uint8], ggml_type: str, source: Any) -> bool:
    """Whether ``raw`` (one tensor's bytes in ``ggml_type``) decodes to ``source``'s values exactly
    (bit for bit, except that ``-0.0`` equals ``0.0``, as it does in every product llama.cpp forms).

    ``source``: the tensor's values, a torch tensor or a numpy array of any float dtype (BF16 is
    compared as its bit patterns, with no float32 copy).
    """
    bits, shift = _source_bits(source)
    data = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if ggml_type == GGMLTypeName.TQ2_0 and bits.size % _TQ2_BLOCK == 0:
        blocks = data.reshape(-1, _TQ2_BYTES)
        scales = blocks[:, 64:66].copy().view(np.float16).astype(np.float32).reshape(-1)
        return int(_mismatches(blocks[:, :64], scales, bits.reshape(-1, _TQ2_BLOCK), shift, True)) == 0
    if ggml_type == GGMLTypeName.Q2_0 and bits.size % _Q2_BLOCK == 0:
        blocks = data.reshape(-1, _Q2_BYTES)
        scales = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
        return int(_mismatches(blocks[:, 2:], scales, bits.reshape(-1, _Q2_BLOCK), shift, False)) == 0
    values = (bits.astype(np.uint32) << np.uint32(shift)).view(np.float32)
    return bool(np.array_equal(decode_bytes(data, ggml_type, values.shape), values))


def _source_bits(source: Any) -> tuple[npt.NDArray[Any], int]:
    """The source's values as bit patterns the compiled loops compare: BF16 as uint16 (shift 16),
    everything else as float32's uint32 (shift 0)."""
    if hasattr(source, "detach"):  # a torch tensor; BF16 has no numpy dtype of its own
        import torch

        tensor = source.detach().contiguous()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(np.uint16), 16
        return tensor.to(torch.float32).numpy().view(np.uint32), 0
    return np.ascontiguousarray(source, dtype=np.float32).view(np.uint32), 0
