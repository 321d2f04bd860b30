"""Where each stage runs and for how long: plain tables, readable without Celery (metrics, CLI, docs).

Queues are by resource: ``io`` (download, checksum), ``cpu`` (inspect, package), ``gpu``
(calibrate, decompose, validate; a CPU-only worker can serve it too).
"""

from __future__ import annotations

from pipeline.core.states import StageName

__all__ = ["QUEUES", "QUEUE_OF", "TIME_LIMITS_S", "VISIBILITY_TIMEOUT_S", "task_name"]

QUEUES = ("io", "cpu", "gpu")

QUEUE_OF: dict[StageName, str] = {
    StageName.DOWNLOAD: "io",
    StageName.CHECKSUM: "io",
    StageName.INSPECT: "cpu",
    StageName.PACKAGE: "cpu",
    StageName.CALIBRATE: "gpu",
    StageName.SENSITIVITY: "gpu",
    StageName.DECOMPOSE: "gpu",
    StageName.VALIDATE: "gpu",
}

# (soft, hard) seconds per stage: soft raises inside the task, hard kills the child.
TIME_LIMITS_S: dict[StageName, tuple[int, int]] = {
    StageName.DOWNLOAD: (6 * 3600, 6 * 3600 + 300),
    StageName.CHECKSUM: (2 * 3600, 2 * 3600 + 300),
    StageName.INSPECT: (1800, 1900),
    StageName.CALIBRATE: (6 * 3600, 6 * 3600 + 300),
    StageName.SENSITIVITY: (12 * 3600, 12 * 3600 + 300),
    StageName.DECOMPOSE: (12 * 3600, 12 * 3600 + 300),
    StageName.PACKAGE: (4 * 3600, 4 * 3600 + 300),
    StageName.VALIDATE: (3600, 3900),
}

# Redis redelivers an unacked message after this; it must outlast the longest task.
VISIBILITY_TIMEOUT_S = max(hard for _soft, hard in TIME_LIMITS_S.values()) + 3600


def task_name(stage: StageName) -> str:
    """Celery task name of a stage: ``stage.<name>``."""
    return f"stage.{stage.value}"

