"""How many threads a stage's libraries get in a worker process, so workers on one machine share its cores."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["limit_threads", "threads_per_child"]

log = logging.getLogger(__name__)


def threads_per_child(worker_threads: int, concurrency: int) -> int:
    """BONSAI_WORKER_THREADS when set, else the cores split among the worker's pool children."""
    if worker_threads or concurrency <= 1:
        return worker_threads
    return max(1, (os.cpu_count() or 1) // concurrency)


# What each library reads when it starts its thread pool; set before the first import.
_THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def limit_threads(threads: int) -> None:
    """Give numba and torch `threads` threads in this process, so workers on one machine share its cores.

    0 leaves the libraries' thread counts (one per core). Libraries not imported yet read the
    variables when they start; those already imported are told directly. Either way, OpenMP's
    idle threads sleep rather than spin (unless OMP_WAIT_POLICY says otherwise): on a busy
    2-core machine spinning threads took the cores from the working one and made decompose
    2-3x slower (bench/scaling.py, issue 14).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads <= 0:
        return
    for name in _THREAD_VARIABLES:
        os.environ[name] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    if "numba" in sys.modules:
        numba = sys.modules["numba"]
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    log.info("worker threads: %d for numba and torch (BONSAI_WORKER_THREADS)", threads)
