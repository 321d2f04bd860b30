"""The Celery app, built on demand from Settings (never from the environment at import).

The broker only carries "run stage run N"; the database holds everything else, so
there is no result store (`NoResults`). Workers send task events, so Flower and
`celery events` show every task as it is received, started, finished or revoked. Late acks
with reject-on-worker-lost give a message back to the broker when a worker dies, and the
atomic claim in the database keeps a second delivery from making a second attempt.
"""

from __future__ import annotations

from functools import cache

from celery import Celery, states
from celery.backends.base import DisabledBackend
from kombu import Queue  # type: ignore[attr-defined]

from pipeline.core.settings import Settings
from pipeline.orchestration.queues import QUEUE_OF, QUEUES, VISIBILITY_TIMEOUT_S, task_name

__all__ = ["app_for", "make_app", "NoResults"]


class NoResults(DisabledBackend):  # type: ignore[misc]
    """No result store, and says so politely: every task's state is unknown (PENDING).

    Celery's own disabled backend raises on any state lookup, and a revoke broadcast makes every
    worker that does not hold the task look its state up, so each cancel logged "No result
    backend is configured" once per idle worker. Nothing here reads task results: the
    attempt's row in the database is the truth.
    """

    def get_state(self, task_id: str) -> str:
        return str(states.PENDING)

    get_status = get_state


def make_app(broker_url: str) -> Celery:
    """A Celery app on `broker_url` with our queues, routes and long-task settings.

    Senders need nothing more (they send by task name); a worker also registers the tasks
    (`tasks.register_tasks`).
    """
    app = Celery("bonsai", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_queues=[Queue(name) for name in QUEUES],  # type: ignore[no-untyped-call]
        task_routes={task_name(stage): {"queue": queue} for stage, queue in QUEUE_OF.items()},
        task_ignore_result=True,
        result_backend=f"{__name__}:NoResults",
        worker_send_task_events=True,  # Flower lists tasks, not only workers
        task_send_sent_event=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT_S,
            # A worker of several queues takes from each in turn: admission bounds every queue, and a
            # fixed order would leave a later queue's admitted attempts (another team's, say) behind an
            # earlier queue that never runs dry. Messages go at one priority (dispatch.send).
            "queue_order_strategy": "round_robin",
            "sep": ":",
        },
        task_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
    )
    return app


@cache
def _app(broker_url: str) -> Celery:
    return make_app(broker_url)


def app_for(settings: Settings) -> Celery:
    """The one app of this process for `settings`' broker (built the first time it is asked for)."""
    if not settings.broker_url:
        raise ValueError("the Celery app needs a broker URL (BONSAI_BROKER_URL); embedded mode has none")
    return _app(settings.broker_url)
