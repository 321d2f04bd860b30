"""Lossless re-packing between llama.cpp's ternary layouts: TQ2_0 / TQ1_0 <-> Q2_0, bytes in, bytes out.

All three decode an element as ``(c - 1) * d`` (code ``c`` in 0..3; TQ1_0 only has 0..2) with
one fp16 ``d`` per block; they differ in block length (256 for TQ, 64 for Q2_0) and in where
the codes sit (`pack`, `pack_bonsai`). So:

- TQ2_0 or TQ1_0 -> Q2_0 is always lossless: every 256-block becomes four 64-blocks, each
  carrying the 256-block's fp16 ``d`` bytes unchanged and the same codes.
- Q2_0 -> TQ2_0 is lossless exactly when the four 64-blocks of each 256-run decode the same
  with one shared ``d``: equal ``d`` bits wherever a block has a non-zero code (an all-zero
  block only needs a ``d`` that gives it the same signed zeros). Otherwise `q2_0_to_tq2_0`
  raises `NotLossless`, and the caller must re-fit (and say so) instead.

"Lossless" here means the float32 values llama.cpp decodes are identical bit for bit; the
checks compare exactly that. Row boundaries are the caller's: a Q2_0 tensor whose rows are not
a multiple of 256 weights cannot become TQ2_0 at all.

Example::

    q2 = tq_to_q2_0(tq2_bytes, "TQ2_0")          # runs on CUDA, same weights
    back = q2_0_to_tq2_0(q2)                      # == tq2_bytes when every d is positive
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import BONSAI_TYPES

__all__ = ["NotLossless", "tq_to_q2_0", "q2_0_to_tq2_0", "q2_0_lossless_runs"]

_QK_K = 256
_TQ_BYTES = {"TQ2_0": 66, "TQ1_0": 54}
_Q2_BYTES = BONSAI_TYPES["Q2_0"].type_size
_Q2_BLOCK = BONSAI_TYPES["Q2_0"].block_size
_PER_RUN = _QK_K // _Q2_BLOCK
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_READ5 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_READ4 = np.array([1, 3, 9, 27], dtype=np.uint8)

U8Array = npt.NDArray[np.uint8]


class NotLossless(ValueError):
    """Q2_0 -> TQ2_0 would change decoded weights: some 256-run's four scales differ."""

    def __init__(self, n_runs: int, n_lossy: int, first_lossy: int) -> None:
        super().__init__(
            f"{n_lossy} of {n_runs} 256-weight runs of this Q2_0 tensor hold 64-blocks with different "
            f"scales (first: run {first_lossy}); TQ2_0 has one scale per 256 weights, so it cannot "
            "hold them losslessly: re-fit the tensor as TQ2_0 from its weights instead"
        )
        self.n_runs, self.n_lossy, self.first_lossy = n_runs, n_lossy, first_lossy


def _as_blocks(raw: npt.ArrayLike, block_bytes: int, name: str) -> U8Array:
    data = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if data.size % block_bytes:
        raise ValueError(f"{data.size} bytes are not whole {name} blocks of {block_bytes} bytes")
    return data.reshape(-1, block_bytes)


def _tq2_codes(blocks: U8Array) -> U8Array:
    """TQ2_0 codes [n, 256]: element n at byte 32 (n // 128) + n % 32, plane (n % 128) // 32."""
    planes = blocks[:, :64].reshape(-1, 2, 1, 32) >> _SHIFTS.reshape(1, 1, 4, 1)
    return (planes & 3).astype(np.uint8).reshape(-1, _QK_K)


def _trits(b: U8Array, powers: U8Array) -> U8Array:
    """llama.cpp's TQ1_0 read: trit i of byte q is ((q * 3^i mod 256) * 3) >> 8, most significant first."""
    shifted = b[:, None, :] * powers.reshape(1, -1, 1)  # uint8 wrap-around is the mod 256
    return ((shifted.astype(np.uint16) * 3) >> 8).astype(np.uint8)


def _tq1_codes(blocks: U8Array) -> U8Array:
    """Raw codes [n, 256] (0, 1, 2) of TQ1_0 blocks, in llama.cpp's element order."""
    n = blocks.shape[0]
    parts = [
        _trits(blocks[:, :32], _READ5).reshape(n, 160),
        _trits(blocks[:, 32:48], _READ5).reshape(n, 80),
        _trits(blocks[:, 48:52], _READ4).reshape(n, 16),
    ]
    return np.concatenate(parts, axis=1)


def _q2_pack_codes(codes: U8Array, d_bytes: U8Array) -> U8Array:
    """Q2_0 blocks from raw codes [n, 64] (0..3) and fp16 bytes [n, 2]."""
    qs = np.bitwise_or.reduce(codes.reshape(-1, _Q2_BLOCK // 4, 4) << _SHIFTS, axis=2)
    return np.concatenate([d_bytes, qs], axis=1).reshape(-1)


def tq_to_q2_0(raw: npt.ArrayLike, source_type: str) -> U8Array:
    """TQ2_0 or TQ1_0 bytes (``[n_blocks * 66]`` / ``[n_blocks * 54]``) as Q2_0 bytes ``[n_blocks * 4 * 18]``.

    The decoded weights are identical bit for bit: the same codes and each 256-block's fp16
    ``d`` bytes copied into its four 64-blocks. Raises ValueError for another type or a byte
    count that is not whole blocks.
    """
    if source_type not in _TQ_BYTES:
        raise ValueError(f"{source_type!r} cannot be re-packed as Q2_0 here; expected TQ2_0 or TQ1_0")
    blocks = _as_blocks(raw, _TQ_BYTES[source_type], source_type)
    codes = _tq2_codes(blocks) if source_type == "TQ2_0" else _tq1_codes(blocks)
    d_bytes = np.repeat(blocks[:, -2:], _PER_RUN, axis=0)
    return _q2_pack_codes(codes.reshape(-1, _Q2_BLOCK), d_bytes)


def _q2_parts(raw: npt.ArrayLike) -> tuple[U8Array, U8Array, npt.NDArray[np.float16]]:
    """(raw codes [runs, 256], d bytes [runs, 4, 2], d [runs, 4]) of Q2_0 bytes grouped in 256-runs."""
    blocks = _as_blocks(raw, _Q2_BYTES, "Q2_0")
    if blocks.shape[0] % _PER_RUN:
        raise ValueError(f"{blocks.shape[0]} Q2_0 blocks are not whole 256-weight runs of {_PER_RUN}")
    codes = ((blocks[:, 2:, None] >> _SHIFTS) & 3).astype(np.uint8).reshape(-1, _QK_K)
    d_bytes = blocks[:, :2].reshape(-1, _PER_RUN, 2)
    d: npt.NDArray[np.float16] = d_bytes.copy().view("<f2").reshape(-1, _PER_RUN)
    return codes, d_bytes, d


def _decoded_bits(codes: U8Array, d: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    """float32 bit patterns llama.cpp decodes: (c - 1) * d, codes [runs, 4, 64], d [runs, 4]."""
    values = (codes.astype(np.float32) - np.float32(1)) * d[..., None]
    return values.view(np.uint32)


def q2_0_lossless_runs(raw: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Per 256-weight run of Q2_0 bytes: True when one shared scale decodes all four blocks identically.

    The shared scale is the first block's with a non-zero code (the first block's when none
    has one). Raises ValueError when the bytes are not whole runs.
    """
    codes, _, d = _q2_parts(raw)
    return _lossless(codes, d)[0]


def _lossless(
    codes: U8Array, d: npt.NDArray[np.float16]
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.intp]]:
    per_block = codes.reshape(-1, _PER_RUN, _Q2_BLOCK)
    has_level = (per_block != 1).any(axis=2)
    source = np.where(has_level.any(axis=1), has_level.argmax(axis=1), 0)
    d32 = d.astype(np.float32)
    shared = np.take_along_axis(d32, source[:, None], axis=1)
    with np.errstate(invalid="ignore"):
        own = _decoded_bits(per_block, d32)
        common = _decoded_bits(per_block, np.broadcast_to(shared, d32.shape))
    return (own == common).all(axis=(1, 2)), source


def q2_0_to_tq2_0(raw: npt.ArrayLike) -> U8Array:
    """Q2_0 bytes (``[n_runs * 4 * 18]``, whole 256-weight runs of one row) as TQ2_0 bytes ``[n_runs * 66]``.

    Lossless or nothing: raises `NotLossless` (a ValueError naming how many runs and the first)
    when any run's blocks cannot share one scale; ValueError for bytes that are not whole runs.
    """
    codes, d_bytes, d = _q2_parts(raw)
    ok, source = _lossless(codes, d)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        raise NotLossless(int(ok.size), int(bad.size), int(bad[0]))
    planes = codes.reshape(-1, 2, 4, 32) << _SHIFTS.reshape(1, 1, 4, 1)
    qs = np.bitwise_or.reduce(planes, axis=2).reshape(-1, 64)
    shared = np.take_along_axis(d_bytes, source[:, None, None], axis=1).reshape(-1, 2)
    return np.concatenate([qs, shared], axis=1).reshape(-1)
