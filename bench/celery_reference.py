"""Reference for the orchestration benchmark: bare Celery doing the same hops, with no database.

A "job" is six tasks, each sending the next, on the same Redis broker and the same worker
settings (late acks, prefetch 1). The last task stamps the job's end time in Redis. What
bonsai adds on top of this is its bookkeeping: claims, rows, provenance, stored files.
"""

from __future__ import annotations

import os
import time

from celery import Celery

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/12")
HOPS = 6

app = Celery("bench-reference", broker=BROKER_URL)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_default_queue="reference",
    worker_hijack_root_logger=False,
)


@app.task(name="reference.hop")
def hop(job_id: int, index: int, started_at: float) -> None:
    if index + 1 < HOPS:
        hop.apply_async((job_id, index + 1, started_at))
        return
    with app.connection_for_write() as connection:
        client = connection.default_channel.client
        client.hset("reference:done", str(job_id), f"{started_at},{time.time()}")
