"""What a worker process holds: its Settings, one Runtime and one Dispatcher per process (after the fork).

`bonsai worker` calls `configure(settings)` before Celery starts, so every pool child (forked
from it) runs with the settings the command was given; a worker started some other way
(``celery -A workers``) reads them from the environment once.
"""

from __future__ import annotations

import logging
import os
from functools import cache

from celery.signals import worker_process_init

from pipeline.core.settings import Settings
from pipeline.orchestration.bootstrap import build_runtime, forget_engines_after_fork
from pipeline.orchestration.distributed.dispatch import Dispatcher
from pipeline.orchestration.runtime import Runtime

__all__ = ["configure", "settings", "runtime", "dispatcher"]

log = logging.getLogger(__name__)

_configured: list[Settings] = []


def configure(worker_settings: Settings) -> None:
    """Use `worker_settings` in this process and in the pool children forked from it."""
    _configured[:] = [worker_settings]


def settings() -> Settings:
    if not _configured:
        _configured.append(Settings.from_env().validate_all())
    return _configured[0]


@cache
def _runtime_for(pid: int) -> Runtime:
    return build_runtime(settings())


def runtime() -> Runtime:
    # Keyed by pid: a forked pool child must never share its parent's database sockets.
    return _runtime_for(os.getpid())


def dispatcher() -> Dispatcher:
    return Dispatcher.of(runtime())


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _forget_parent_connections(**_kwargs: object) -> None:
    forget_engines_after_fork()
    _warm_up_kernel()


def _warm_up_kernel() -> None:
    # Load the compiled ternary kernel at start-up, not inside the first decompose it serves.
    from pipeline.ternary import kernel

    try:
        log.info("ternary kernel ready in %.2fs", kernel.warm_up())
    except Exception:  # noqa: BLE001 - not fatal here: the first decompose reports the same error
        log.warning("ternary kernel could not be loaded", exc_info=True)
