"""Whether the compiled kernel for a ternary type still has to be compiled on this machine.

numba keeps the machine code of each codec's kernel on disk (next to its sources);
the first decomposition on a machine compiles it once (tens of seconds for a model of any
size), later ones load it. `bonsai convert` asks `is_cold` first, to say so instead of
looking stuck. `load_cached` loads what the cache holds ahead of the stage, compiling nothing.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.codecs import CODECS, codec_for
from pipeline.ternary.kernel import is_available

__all__ = ["is_cold", "load_cached", "warm_up", "COMPILE_ESTIMATE_S"]

# Seconds the first compile of each type's kernel takes here (measured on two cores).
COMPILE_ESTIMATE_S = {name: codec.compile_estimate_s for name, codec in CODECS.items()}


def _dispatcher(ggml_type: str) -> Any:
    codec = CODECS.get(ggml_type)
    return None if codec is None else codec.kernel_entry()


def is_cold(ggml_type: str) -> bool:
    """True when fitting `ggml_type` here would compile the kernel first (no fresh cached code on disk).

    False when numba is missing (no kernel to compile), the type has no kernel, this process
    compiled it already, or numba's cache cannot be read (unknown: say nothing).
    """
    if not is_available():
        return False
    dispatcher = _dispatcher(ggml_type.upper())
    if dispatcher is None or dispatcher.signatures:
        return False
    try:
        # numba's own index reader: empty when the index is missing, of another numba, or stale.
        return not dispatcher._cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - a private numba API: any change means "unknown"
        return False


def load_cached(ggml_type: str) -> int:
    """Load every variant of `ggml_type`'s kernel that numba's cache holds for this CPU; returns how many.

    Compiles nothing: a variant that is not cached (or cached for another CPU) is left for its
    first call, so a background warm-up never spends tens of seconds of CPU a job may not need.
    0 when numba is missing, the type has no kernel, or the cache cannot be read.
    """
    if not is_available():
        return 0
    dispatcher = _dispatcher(ggml_type.upper())
    if dispatcher is None:
        return 0
    try:
        index = dispatcher._cache._cache_file._load_index()
        this_cpu = dispatcher.targetctx.codegen().magic_tuple()
        # Index keys: (argument types, the CPU the code was made for, numba's own flags).
        cached = [key[0] for key in index if key[1] == this_cpu]
    except Exception:  # noqa: BLE001 - a private numba API: any change means "nothing to load"
        return 0
    loaded = 0
    for signature in cached:
        if signature not in dispatcher.overloads:
            dispatcher.compile(signature)  # a cache hit: numba loads the machine code
            loaded += 1
    return loaded


def warm_up(*ggml_types: str) -> float:
    """Load the kernels of ``ggml_types`` (default TQ2_0) now rather than in the first fit; returns seconds.

    Every variant a fit may take: float32 and bfloat16 weights, each level count, uniform and
    weighted. From numba's cache ~0.3 s once per process (a long-lived worker calls it when it
    starts); on a machine that has never compiled them, tens of seconds.
    """
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
