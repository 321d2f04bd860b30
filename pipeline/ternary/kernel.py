"""The compiled CPU kernels behind the codecs: whether they can run, their threads and totals.

Each low-bit codec (`codecs`) fits, packs and sums errors in one compiled pass per block
(numba, ``prange`` over chunks of blocks, every CPU core). numba caches the compiled code on
disk, so only the first run on a machine compiles it (~15 s for TQ, ~30 s for Q2_0/Q1_0);
`kernel_cache.warm_up` loads it (~0.3 s per process). This module sits below the codecs and
names none of them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["KernelStats", "is_available", "thread_count"]


@dataclass(frozen=True)
class KernelStats:
    """Totals over the blocks of one `Codec.fit_pack` call (float64 sums)."""

    sq_error: float
    absmean_sq_error: float
    sq_norm: float
    n_nonzero: int


def is_available() -> bool:
    """True when numba is installed (the kernel compiles or loads from cache on first use)."""
    return importlib.util.find_spec("numba") is not None


def thread_count() -> int:
    """Threads the kernel runs on (numba's: by default one per CPU core); 0 without numba."""
    if not is_available():
        return 0
    import numba

    return int(numba.get_num_threads())
