"""Compiled CPU kernel: exact optimal fit, packing and error sums in one pass per 256-weight block.

`fit_pack(blocks, ggml_type, out)` takes ``[n_blocks, 256]`` weights (float32, or bfloat16 as
stored) and writes their TQ2_0 or TQ1_0 bytes into ``out``; it returns the summed squared
errors. Its bytes are those of `fit.fit_optimal` (uniform importance) followed by
`pack.pack_ternary`; the unit tests check that bit for bit. It runs on every CPU core (numba
``prange`` over chunks of blocks), and numba caches the compiled code on disk, so only the
first run on a machine compiles it (~20 s); `warm_up` loads it (~0.3 s per process).

Finding the optimal count k without sorting the block. For a scale ``d`` the best codes keep
exactly the weights with ``|w| > d/2``, and the error then falls by ``H(d) = sum_i max(0,
d (2|w_i| - d))``; the optimum ``F* = max_k S_k^2 / k`` (``S_k``: sum of the k largest
``|w|``) is ``max_d H(d)``. ``H'(d) = 2 N(d) (g(d) - d)``, where ``N(d)`` and ``g(d)`` are the
count and mean of ``{|w| > d/2}``, and ``g`` never decreases as ``d`` grows. So if
``p' <= g(p)``, ``H`` rises on ``[p, p']`` (there ``g(d) >= g(p) >= p' > d``), and if
``p' >= g(p)`` it falls on ``[p', p]``. Two chains of such steps, one up from mean ``|w|``
(below which ``H`` rises) and one down from ``max |w|`` (above which it falls), confine every
maximiser to ``[2 t_lo, 2 t_hi]``: an optimal set keeps all weights above ``t_hi`` and none
below ``t_lo``. Three chain steps (vectorised passes; float32 sums, whose rounding the steps
allow for by stopping 4e-5 short) leave ~12 of the 256 weights in between; those are sorted
and every count they allow is scored exactly as the reference scores it: ``S_k`` in float64
(exact, since every term is within a factor 2^21 of ``max |w|``), ``S_k^2 / k`` in float64,
the first maximum. The window is widened by 1e-6 so that counts whose float64 objective is
within rounding of the optimum are scored too.

Reported errors are ``sum w^2 - 2 d S_k + d^2 k`` with exact ``S_k`` and ``d``; where that is
below 1e-6 of ``sum w^2`` (nearly or exactly ternary blocks) they are summed term by term.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["KernelStats", "BLOCK_BYTES", "is_available", "warm_up", "thread_count", "fit_pack"]

BLOCK_BYTES = {"TQ2_0": 66, "TQ1_0": 54}
_QK = 256
_CHUNK_BLOCKS = 64  # blocks per parallel work item (~64 KB of float32 weights)


@dataclass(frozen=True)
class KernelStats:
    """Totals over the blocks of one `fit_pack` call (float64 sums)."""

    sq_error: float
    absmean_sq_error: float
    sq_norm: float
    n_nonzero: int


def is_available() -> bool:
    """True when numba is installed (the kernel compiles or loads from cache on first use)."""
    return importlib.util.find_spec("numba") is not None


def warm_up() -> float:
    """Load the compiled kernel now rather than inside the first decomposition; returns seconds.

    From numba's cache this takes ~0.3 s once per process (a long-lived worker calls it when
    it starts); on a machine that has never compiled it, ~20 s.
    """
    started = time.perf_counter()
    if is_available():
        fit_pack(np.zeros((1, _QK), np.float32), "TQ2_0")
        fit_pack(np.zeros((1, _QK), np.uint16), "TQ2_0")
    return time.perf_counter() - started


def thread_count() -> int:
    """Threads the kernel runs on (numba's: by default one per CPU core); 0 without numba."""
    if not is_available():
        return 0
    import numba

    return int(numba.get_num_threads())


def fit_pack(
    blocks: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
    ggml_type: str,
    out: npt.NDArray[np.uint8] | None = None,
) -> tuple[npt.NDArray[np.uint8], KernelStats]:
    """Fit and pack ``blocks`` ``[n_blocks, 256]`` as ``ggml_type`` (TQ2_0 or TQ1_0) bytes.

    ``blocks``: float32, or uint16 holding bfloat16 bit patterns (read as stored, no float32
    copy). ``out``: optional uint8 buffer of at least ``n_blocks * BLOCK_BYTES[ggml_type]``
    bytes, reused so that a stream of tensors allocates nothing; the returned bytes are a
    view of it. Raises ValueError for non-finite weights, a bad shape, dtype or type, or when
    numba is missing.

    Example::

        raw, stats = fit_pack(w.reshape(-1, 256), "TQ2_0")   # same bytes as pack_tq2_0(*fit_optimal(w))
    """
    if not is_available():
        raise ValueError("the compiled kernel needs numba; use fit.fit_optimal and pack.pack_ternary")
    from pipeline.ternary import _kernel_tq_impl

    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"{ggml_type!r} is not a ternary type; expected one of {sorted(BLOCK_BYTES)}")
    if blocks.dtype not in (np.float32, np.uint16) or blocks.ndim != 2 or blocks.shape[1] != _QK:
        raise ValueError(
            f"blocks must be float32 or bfloat16-as-uint16 [n_blocks, {_QK}], "
            f"got {blocks.dtype} {blocks.shape}"
        )
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
        _kernel_tq_impl.fit_pack_all(src, 16 if bf16 else 0, view, stats, _CHUNK_BLOCKS, ggml_type == "TQ1_0")
    totals = stats.sum(axis=0)
    if totals[4] > 0:
        raise ValueError(f"the weights hold NaN or infinite values ({int(totals[4])} blocks of 256)")
    return view, KernelStats(float(totals[0]), float(totals[1]), float(totals[2]), int(totals[3]))
