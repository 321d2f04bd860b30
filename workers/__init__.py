"""Entry point for Celery's own command line: ``celery -A workers worker -Q io,cpu,gpu``.

`bonsai worker` is the usual way to start a worker; this thin package exists for tools that
expect a Celery app module (Flower, ``celery inspect``). Settings come from the ``BONSAI_*``
variables, read here, at the edge. Nothing in ``pipeline/`` imports it.
"""

from __future__ import annotations

from pipeline.orchestration.distributed import worker_process
from pipeline.orchestration.distributed.celery_app import app_for
from pipeline.orchestration.distributed.tasks import register_tasks

app = app_for(worker_process.settings())
register_tasks(app)

__all__ = ["app"]
