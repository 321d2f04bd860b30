"""Lossless re-packing between llama.cpp's ternary layouts: TQ2_0 / TQ1_0 <-> Q2_0, bytes in, bytes out.

All three decode an element as ``(c - 1) * d`` (code ``c`` in 0..3; TQ1_0 only has 0..2) with
one fp16 ``d`` per block; they differ in block length (256 for TQ, 64 for Q2_0) and in where
the codes sit (their `codecs`). So:

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

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.codecs import CODECS

__all__ = ["NotLossless", "tq_to_q2_0", "q2_0_to_tq2_0", "q2_0_lossless_runs"]

_QK_K = 256
_TQ_TYPES = (GGMLTypeName.TQ2_0, GGMLTypeName.TQ1_0)
_Q2 = CODECS[GGMLTypeName.Q2_0]
_PER_RUN = _QK_K // _Q2.block_size

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


def tq_to_q2_0(raw: npt.ArrayLike, source_type: str) -> U8Array:
    """TQ2_0 or TQ1_0 bytes (``[n_blocks * 66]`` / ``[n_blocks * 54]``) as Q2_0 bytes ``[n_blocks * 4 * 18]``.

    The decoded weights are identical bit for bit: the same codes and each 256-block's fp16
    ``d`` bytes copied into its four 64-blocks. Raises ValueError for another type or a byte
    count that is not whole blocks.
    """
    if source_type not in _TQ_TYPES:
        raise ValueError(f"{source_type!r} cannot be re-packed as Q2_0 here; expected TQ2_0 or TQ1_0")
    source = CODECS[source_type]
    blocks = source.blocks(raw)
    d_bytes = np.repeat(source.scale_bytes(blocks), _PER_RUN, axis=0)
    return _Q2.assemble(source.raw_codes(blocks).reshape(-1, _Q2.block_size), d_bytes)


def _q2_parts(raw: npt.ArrayLike) -> tuple[U8Array, U8Array, npt.NDArray[np.float16]]:
    """(raw codes [runs, 256], d bytes [runs, 4, 2], d [runs, 4]) of Q2_0 bytes grouped in 256-runs."""
    blocks = _Q2.blocks(raw)
    if blocks.shape[0] % _PER_RUN:
        raise ValueError(f"{blocks.shape[0]} Q2_0 blocks are not whole 256-weight runs of {_PER_RUN}")
    codes = _Q2.raw_codes(blocks).reshape(-1, _QK_K)
    d_bytes = _Q2.scale_bytes(blocks).reshape(-1, _PER_RUN, 2)
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
    per_block = codes.reshape(-1, _PER_RUN, _Q2.block_size)
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
    shared = np.take_along_axis(d_bytes, source[:, None, None], axis=1).reshape(-1, 2)
    return CODECS[GGMLTypeName.TQ2_0].assemble(codes, shared)
