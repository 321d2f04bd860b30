"""The compiled CPU kernels behind the codecs: whether they can run, warming them, their threads.

Each low-bit codec (`codecs`) fits, packs and sums errors in one compiled pass per block
(numba, ``prange`` over chunks of blocks, every CPU core). numba caches the compiled code on
disk, so only the first run on a machine compiles it (~15 s for TQ, ~30 s for Q2_0/Q1_0);
`warm_up` loads it (~0.3 s per process).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass

import numpy as np

from pipeline.formats.gguf.types import GGMLTypeName

__all__ = ["KernelStats", "is_available", "warm_up", "thread_count"]


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


def warm_up(*ggml_types: str) -> float:
    """Load the kernels of ``ggml_types`` (default TQ2_0) now rather than in the first fit; returns seconds.

    Every variant a fit may take: float32 and bfloat16 weights, each level count, uniform and
    weighted. From numba's cache ~0.3 s once per process (a long-lived worker calls it when it
    starts); on a machine that has never compiled them, tens of seconds.
    """
    from pipeline.ternary.codecs import codec_for

    started = time.perf_counter()
    if is_available():
        for name in ggml_types or (GGMLTypeName.TQ2_0,):
            codec = codec_for(name)
            size = codec.block_size
            weighted = (None, np.ones(size, np.float32)) if codec.kernel_importance else (None,)
            for zeros in (np.zeros((1, size), np.float32), np.zeros((1, size), np.uint16)):
                for levels in codec.levels:
                    for importance in weighted:
                        codec.fit_pack(zeros, levels, importance)
    return time.perf_counter() - started


def thread_count() -> int:
    """Threads the kernel runs on (numba's: by default one per CPU core); 0 without numba."""
    if not is_available():
        return 0
    import numba

    return int(numba.get_num_threads())
