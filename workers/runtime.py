"""One Runtime per worker process, built on first use after the fork."""

from __future__ import annotations

import dataclasses
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
