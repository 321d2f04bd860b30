"""One Runtime per worker process, built on first use after the fork."""

from __future__ import annotations

import dataclasses
import logging
import os
from functools import cache

from celery.signals import worker_process_init

from pipeline.core.settings import Settings
from pipeline.orchestration.execution import Runtime
from pipeline.orchestration.runtime import build_runtime, forget_engines_after_fork

__all__ = ["runtime", "settings"]

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
        from pipeline.orchestration.distributed.dispatch import resend

        for run_id in run_ids:
            resend(rt.sessions, run_id)

    return dataclasses.replace(rt, fanout_dispatch=send_children)


def runtime() -> Runtime:
    # Keyed by pid: a forked pool child must never share its parent's database sockets.
    return _runtime_for(os.getpid())


@worker_process_init.connect
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
