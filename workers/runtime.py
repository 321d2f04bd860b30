"""One Runtime per worker process, built on first use after the fork."""

from __future__ import annotations

import os
from functools import cache

from celery.signals import worker_process_init

from pipeline.bootstrap import build_runtime, forget_engines_after_fork
from pipeline.execution import Runtime
from pipeline.settings import Settings

__all__ = ["runtime", "settings"]


@cache
def settings() -> Settings:
    return Settings.from_env().validate_all()


@cache
def _runtime_for(pid: int) -> Runtime:
    return build_runtime(settings())


def runtime() -> Runtime:
    # Keyed by pid: a forked pool child must never share its parent's database sockets.
    return _runtime_for(os.getpid())


@worker_process_init.connect
def _forget_parent_connections(**_kwargs: object) -> None:
    forget_engines_after_fork()
