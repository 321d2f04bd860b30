"""What a worker process holds: its Settings, one Runtime and one Dispatcher per process (after the fork).

`bonsai worker` calls `configure(settings)` before Celery starts, so every pool child (forked
from it) runs with the settings the command was given; a worker started some other way
(``celery -A workers``) reads them from the environment once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from typing import Any

from celery.signals import worker_process_init, worker_ready, worker_shutdown

from pipeline.core.settings import Settings
from pipeline.orchestration.bootstrap import build_runtime, forget_engines_after_fork
from pipeline.orchestration.distributed.beacon import WorkerBeacon
from pipeline.orchestration.distributed.dispatch import Dispatcher
from pipeline.orchestration.runtime import Runtime
from pipeline.orchestration.threads import limit_threads, threads_per_child

__all__ = ["configure", "settings", "runtime", "dispatcher", "announce"]

log = logging.getLogger(__name__)

_configured: list[Settings] = []


_threads: list[int] = []


def configure(worker_settings: Settings, concurrency: int = 1) -> None:
    """Use `worker_settings` in this process and in the pool children forked from it; each child gets
    BONSAI_WORKER_THREADS threads, or the cores split among `concurrency` children."""
    _configured[:] = [worker_settings]
    _threads[:] = [threads_per_child(worker_settings.worker_threads, concurrency)]


def settings() -> Settings:
    if not _configured:
        _configured.append(Settings.from_env().validate_all())
    return _configured[0]


@cache
def _runtime_for(pid: int) -> Runtime:
    rt = build_runtime(settings())
    cap_mb = settings().worker_memory_mb
    return replace(rt, memory_limit_bytes=cap_mb << 20) if cap_mb else rt


def runtime() -> Runtime:
    # Keyed by pid: a forked pool child must never share its parent's database sockets.
    return _runtime_for(os.getpid())


def dispatcher() -> Dispatcher:
    return Dispatcher.of(runtime())


_beacons: list[WorkerBeacon] = []


def announce(queues: Sequence[str], concurrency: int) -> None:
    """Keep a heartbeat row for this worker from the moment Celery is ready until it shuts down."""

    @worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
    def _start(sender: Any = None, **_kwargs: object) -> None:
        name = str(getattr(sender, "hostname", None) or f"worker@{os.getpid()}")
        cap = runtime().memory_limit_bytes
        beacon = WorkerBeacon(runtime().sessions, name, queues, concurrency, settings().heartbeat_s,
                              cap >> 20 if cap else None)
        beacon.start()
        _beacons.append(beacon)

    @worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
    def _stop(**_kwargs: object) -> None:
        for beacon in _beacons:
            beacon.stop()


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _forget_parent_connections(**_kwargs: object) -> None:
    forget_engines_after_fork()
    limit_threads(_threads[0] if _threads else settings().worker_threads)
    _warm_up_kernel()


def _warm_up_kernel() -> None:
    # Load the compiled ternary kernel at start-up, not inside the first decompose it serves.
    from pipeline.ternary import kernel_cache

    try:
        log.info("ternary kernel ready in %.2fs", kernel_cache.warm_up())
    except Exception:  # noqa: BLE001 - not fatal here: the first decompose reports the same error
        log.warning("ternary kernel could not be loaded", exc_info=True)
