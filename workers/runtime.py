"""One Runtime per worker process, built on first use after the fork."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from functools import cache

from celery.signals import worker_process_init

from pipeline.bootstrap import build_runtime, forget_engines_after_fork
from pipeline.execution import Runtime
from pipeline.settings import Settings

__all__ = ["limit_threads", "runtime", "settings"]

log = logging.getLogger(__name__)


@cache
def settings() -> Settings:
    return Settings.from_env().validate_all()


@cache
def _runtime_for(pid: int) -> Runtime:
    rt = build_runtime(settings())
    if not settings().fanout:
        return rt

    def send_children(run_ids: list[int]) -> None:
        from workers.dispatch import resend

        for run_id in run_ids:
            resend(rt.sessions, run_id)

    return dataclasses.replace(rt, fanout_dispatch=send_children)


def runtime() -> Runtime:
    # Keyed by pid: a forked pool child must never share its parent's database sockets.
    return _runtime_for(os.getpid())


@worker_process_init.connect
def _forget_parent_connections(**_kwargs: object) -> None:
    forget_engines_after_fork()
    limit_threads(settings().worker_threads)
    _warm_up_kernel()


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


def _warm_up_kernel() -> None:
    # Load the compiled ternary kernel at start-up, not inside the first decompose it serves.
    from pipeline.ternary import kernel

    try:
        log.info("ternary kernel ready in %.2fs", kernel.warm_up())
    except Exception:  # noqa: BLE001 - not fatal here: the first decompose reports the same error
        log.warning("ternary kernel could not be loaded", exc_info=True)
