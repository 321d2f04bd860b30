"""Compiled CPU kernel for the Bonsai layouts: the exact Q2_0 / Q1_0 fit, packing and error sums in one pass.

`fit_pack(blocks, ggml_type, levels, importance, out)` takes ``[n_blocks, B]`` weights (B = 64
for Q2_0, 128 for Q1_0; float32, or bfloat16 as stored) and writes their bytes into ``out``.
Its bytes are those of `fit_bonsai.fit_q2_0` / `fit_q1_0` followed by `pack_bonsai`, for every
level count and with or without importance; the unit tests check that bit for bit. It runs on
every core (numba ``prange``) and numba caches the compiled code on disk, keyed on
`_kernel_q_impl` (its own file, so the TQ kernel's cache is not touched).

Q1_0 is one pass. Q2_0 with importance or ``levels=4`` sorts each block (ranks, 64 x 64
comparisons) and walks the same events as `fit_bonsai`, with the same sums in the same order.
Q2_0 ``levels=3`` with uniform importance, the default, avoids the sort:

1. *Chains* (as in `kernel` for TQ): with ``H(d) = sum max(0, d (2|w| - d))`` the error reduction
   at scale ``d`` and ``g(d)`` the mean of ``{|w| > d/2}`` (non-decreasing in ``d``),
   ``H'(d) = 2 N(d/2) (g - d)``. Steps up from mean ``|w|`` and down from max ``|w|``, each
   stopping 1/64 short of the mean's half, certify that ``H`` rises on ``(0, p_lo]`` with slope
   at least ``2 N(d/2) d c`` and falls on ``[p_hi, max|w|]`` as steeply (``c`` = 1/128 after
   float32 rounding of the chain sums), and never rises beyond ``max |w|``.
2. *fp16 slack*. Let ``F*`` be the continuous optimum. If it lies in fp16's normal range, its
   fp16-rounded scale loses at most ``F* 2^-22 <= sum w^2 2^-22``; add a gap ``sum w^2 2^-30``
   (far above float64 rounding) and call the total ``E``. Any candidate that can win (or tie)
   scores at least ``F* - E``. From the slopes, ``H(d) < F* - E`` for ``d < D_lo``
   (``D_lo^2 = p_lo^2 - E / (c N(p_lo/2))``) and for ``d > D_hi = p_hi (1 + 2^-8)`` once
   ``c N(D_hi/2) (D_hi^2 - p_hi^2) > E`` (else no upper bound is used).
3. *Window*. A candidate (the k largest ``|w|``, scale ``d_k``) that keeps some ``|w| <= t_lo``
   with ``t_lo = (D_lo - E / D_lo) / 2``, or drops some ``|w| > t_hi = (D_hi + E / D_lo) / 2``,
   either has ``d_k`` outside ``[D_lo, D_hi]`` (so it scores below ``F* - E``) or loses at least
   ``E`` against re-choosing that weight's level at ``d_k``. So only counts between
   ``#{|w| > t_hi}`` and ``#{|w| > t_lo}`` are scored, in the reference's order and arithmetic:
   the sum of the weights above ``t_hi`` is exact in any order (each is within 2^8 of the
   largest), the few in between are sorted and added one by one.

Blocks outside that regime (max ``|w|`` beyond [2^-60, 2^60], a continuous optimum below fp16's
normal range or above 65504) take the sorting path, which is exact everywhere.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import BONSAI_TYPES
from pipeline.ternary.kernel import KernelStats, is_available

__all__ = ["fit_pack", "warm_up", "BLOCK_SIZE", "BLOCK_BYTES"]

BLOCK_SIZE = {name: t.block_size for name, t in BONSAI_TYPES.items()}
BLOCK_BYTES = {name: t.type_size for name, t in BONSAI_TYPES.items()}
_CHUNK_BLOCKS = 256  # blocks per parallel work item (64 KB of float32 Q2_0 weights)


def warm_up() -> float:
    """Load (or compile, ~30 s the first time on a machine) every variant now; returns seconds."""
    started = time.perf_counter()
    if is_available():
        for name, size in BLOCK_SIZE.items():
            blocks: tuple[npt.NDArray[np.float32] | npt.NDArray[np.uint16], ...] = (
                np.zeros((1, size), np.float32), np.zeros((1, size), np.uint16))
            for zeros in blocks:
                for levels in (3, 4) if name == "Q2_0" else (3,):
                    fit_pack(zeros, name, levels)
                    fit_pack(zeros, name, levels, np.ones(size, np.float32))
    return time.perf_counter() - started


def fit_pack(
    blocks: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
    ggml_type: str,
    levels: int = 3,
    importance: npt.NDArray[np.float32] | None = None,
    out: npt.NDArray[np.uint8] | None = None,
) -> tuple[npt.NDArray[np.uint8], KernelStats]:
    """Fit and pack ``blocks`` ``[n_blocks, B]`` (consecutive blocks of whole rows) as Q2_0 or Q1_0 bytes.

    ``blocks``: float32, or uint16 holding bfloat16 bit patterns. ``levels``: 3 or 4 (Q2_0 only).
    ``importance``: optional non-negative float32 ``[cols]``, one value per column of the rows
    the blocks tile (``cols`` a multiple of B; block i covers columns ``(i % (cols / B)) * B``
    onwards). ``out``: optional reused uint8 buffer of at least ``n_blocks * 18`` bytes; the
    returned bytes are a view of it. Reported errors are unweighted. Raises ValueError for
    non-finite weights or importance, bad shapes, dtypes, types or levels, or without numba.

    Example::

        raw, stats = fit_pack(w.reshape(-1, 64), "Q2_0")   # == pack_q2_0(*fit_q2_0(w.reshape(-1, 64)))
    """
    if not is_available():
        raise ValueError("the compiled kernel needs numba; use fit_bonsai and pack_bonsai")
    from pipeline.ternary import _kernel_q_impl

    if ggml_type not in BLOCK_SIZE:
        raise ValueError(f"{ggml_type!r} is not a Bonsai type; expected one of {sorted(BLOCK_SIZE)}")
    size = BLOCK_SIZE[ggml_type]
    if levels not in (3, 4) or (ggml_type == "Q1_0" and levels != 3):
        raise ValueError(f"levels={levels!r}; Q2_0 takes 3 or 4, Q1_0 has no levels option")
    if blocks.dtype not in (np.float32, np.uint16) or blocks.ndim != 2 or blocks.shape[1] != size:
        raise ValueError(f"blocks must be float32 or bfloat16-as-uint16 [n_blocks, {size}], "
                         f"got {blocks.dtype} {blocks.shape}")
    imp, n_per_row = _importance(importance, size, blocks.shape[0])
    bf16 = blocks.dtype == np.uint16
    src = np.ascontiguousarray(blocks) if bf16 else np.ascontiguousarray(blocks).view(np.int32)
    n_blocks = blocks.shape[0]
    n_bytes = n_blocks * BLOCK_BYTES[ggml_type]
    if out is None:
        out = np.empty(n_bytes, np.uint8)
    if out.dtype != np.uint8 or out.ndim != 1 or out.size < n_bytes:
        raise ValueError(f"out must be a 1-D uint8 buffer of at least {n_bytes} bytes")
    view = out[:n_bytes]
    stats = np.zeros((max(1, -(-n_blocks // _CHUNK_BLOCKS)), 8))  # 64-byte rows: no false sharing
    if n_blocks:
        import numba

        # Hand the chunks out as threads free up, not in one fixed share per thread: on a machine
        # others share, a thread that loses its core would otherwise hold the whole call up.
        previous = numba.set_parallel_chunksize(1)
        try:
            _kernel_q_impl.fit_pack_all(src, 16 if bf16 else 0, imp, n_per_row, view, stats,
                                                    _CHUNK_BLOCKS, ggml_type == "Q1_0", levels,
                                                    BLOCK_BYTES[ggml_type])
        finally:
            numba.set_parallel_chunksize(previous)
    totals = stats.sum(axis=0)
    if totals[4] > 0:
        raise ValueError(f"the weights hold NaN or infinite values ({int(totals[4])} blocks of {size})")
    return view, KernelStats(float(totals[0]), float(totals[1]), float(totals[2]), int(totals[3]))


def _importance(
    importance: npt.NDArray[np.float32] | None, size: int, n_blocks: int
) -> tuple[npt.NDArray[np.float32], int]:
    """(importance as contiguous float32, blocks per row); an empty array means uniform."""
    if importance is None:
        return np.empty(0, np.float32), 1
    imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if imp.size == 0 or imp.size % size:
        raise ValueError(f"importance has {imp.size} values; expected a positive multiple of {size}")
    if not np.all(np.isfinite(imp)) or bool((imp < 0).any()):
        raise ValueError("importance must be finite and non-negative")
    n_per_row = imp.size // size
    if n_blocks % n_per_row:
        raise ValueError(f"{n_blocks} blocks do not tile rows of {imp.size} columns")
    return imp, n_per_row
