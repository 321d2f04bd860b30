"""The Celery app: broker from Settings, queues by resource, settings for long tasks.

The broker only carries "run stage run N"; the database holds everything else, so
there is no result backend. Late acks with reject-on-worker-lost give a message back
to the broker when a worker dies, and the atomic claim in the database keeps a second
delivery from making a second attempt.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from pipeline.core.settings import Settings
from pipeline.core.states import StageName

__all__ = ["QUEUE_OF", "TIME_LIMITS_S", "QUEUES", "make_app", "app", "task_name"]

QUEUES = ("io", "cpu", "gpu")

QUEUE_OF: dict[StageName, str] = {
    StageName.DOWNLOAD: "io",
    StageName.CHECKSUM: "io",
    StageName.INSPECT: "cpu",
    StageName.PACKAGE: "cpu",
    StageName.DECOMPOSE: "gpu",
    StageName.VALIDATE: "gpu",
}

# (soft, hard) seconds per stage: soft raises inside the task, hard kills the child.
TIME_LIMITS_S: dict[StageName, tuple[int, int]] = {
    StageName.DOWNLOAD: (6 * 3600, 6 * 3600 + 300),
    StageName.CHECKSUM: (2 * 3600, 2 * 3600 + 300),
    StageName.INSPECT: (1800, 1900),
    StageName.DECOMPOSE: (12 * 3600, 12 * 3600 + 300),
    StageName.PACKAGE: (4 * 3600, 4 * 3600 + 300),
    StageName.VALIDATE: (3600, 3900),
}

# Redis redelivers an unacked message after this; it must outlast the longest task.
VISIBILITY_TIMEOUT_S = max(hard for _soft, hard in TIME_LIMITS_S.values()) + 3600


def task_name(stage: StageName) -> str:
    return f"stage.{stage.value}"


def make_app(settings: Settings) -> Celery:
    app = Celery("bonsai", broker=settings.broker_url or "redis://127.0.0.1:6379/0")
    app.conf.update(
        task_queues=[Queue(name) for name in QUEUES],  # type: ignore[no-untyped-call]
        task_routes={task_name(stage): {"queue": queue} for stage, queue in QUEUE_OF.items()},
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT_S,
            # Priorities 0 (first) .. 9 (last), each its own Redis list.
            "queue_order_strategy": "priority",
            "priority_steps": list(range(10)),
            "sep": ":",
        },
        task_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        include=["pipeline.orchestration.distributed.tasks"],
    )
    return app


app = make_app(Settings.from_env())
