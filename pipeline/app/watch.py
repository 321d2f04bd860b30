"""What `bonsai status` prints: the jobs' progress, their retries, and what they wait on.

On a terminal `--watch` redraws one table; into a pipe or a file it prints a plain line each
time a job changes, so `bonsai status --watch 2 | tee log` reads like a log. Either way it
returns once every watched job has finished. In distributed mode a job whose next stage sits on
a queue that no live worker serves gets a warning instead of looking merely slow.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from pipeline.app import views
from pipeline.app.terminal import markup_safe, printable
from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import Job
from pipeline.db.session import session_scope
from pipeline.orchestration.queues import QUEUE_OF
from pipeline.orchestration.runtime import Runtime

__all__ = ["JobLine", "Snapshot", "take_snapshot", "watch_status"]

_WAITING = (StageState.PENDING, StageState.QUEUED)


@dataclass(frozen=True)
class JobLine:
    """One job as `status` shows it; ``attempt`` is the current stage's newest attempt number."""

    job_id: int
    status: str
    progress: float
    stage: str | None
    attempt: int | None
    retries: int
    cached: int
    source: str
    waiting_queue: str | None  # the queue the job waits on, when no live worker serves it
    why_waiting: str | None = None  # why its attempt waits for admission (distributed mode)

    def plain(self) -> str:
        where = f" {self.stage} (attempt {self.attempt})" if self.stage and self.attempt else ""
        extra = f", {self.retries} retried" if self.retries else ""
        extra += f", {self.cached} from cache" if self.cached else ""
        return f"job {self.job_id} {self.status}{where} {self.progress:.0%}{extra}  {printable(self.source)}"


@dataclass(frozen=True)
class Snapshot:
    lines: tuple[JobLine, ...]
    idle_queues: tuple[str, ...]  # queues no live worker serves (empty in embedded mode)

    @property
    def is_done(self) -> bool:
        return all(JobState(line.status).is_final for line in self.lines)

    def warnings(self) -> list[str]:
        idle = [f"warning: job {line.job_id} waits on queue {line.waiting_queue!r}, which no live worker "
                f"serves; start one (`bonsai worker --queues {line.waiting_queue}`) or see `bonsai workers`"
                for line in self.lines if line.waiting_queue]
        return idle + [f"job {line.job_id} waits: {line.why_waiting}" for line in self.lines
                       if line.why_waiting and not line.waiting_queue]


def _line(job: Job, idle_queues: Sequence[str], why: Mapping[int, str]) -> JobLine:
    summary = views.job_summary(job)
    runs = [run for run in job.stage_runs if not run.shard]
    stage = summary["current_stage"]
    current = [run for run in runs if run.stage == stage]
    newest = max(current, key=lambda run: run.attempt) if current else None
    waiting = None
    if stage and newest is not None and newest.status in _WAITING and not job.status.is_final:
        queue = QUEUE_OF[StageName(stage)]
        waiting = queue if queue in idle_queues else None
    return JobLine(
        job_id=job.id, status=job.status, progress=summary["progress"], stage=stage,
        attempt=newest.attempt if newest is not None else None,
        retries=sum(1 for run in runs if run.attempt > 1),
        cached=sum(1 for run in runs if run.status == StageState.SKIPPED_CACHED),
        source=job.source, waiting_queue=waiting,
        why_waiting=next((f"{run.stage}: {why[run.id]}" for run in runs if run.id in why), None),
    )


def take_snapshot(rt: Runtime, job_ids: Sequence[int] | None, status: str | None,
                  heartbeat_timeout_s: float | None) -> Snapshot:
    """The jobs asked for (all, or `job_ids`, or those in `status`) and the queues nobody serves.

    `heartbeat_timeout_s` None (embedded mode) skips the worker lookup: there are no workers.
    """
    with session_scope(rt.sessions) as session:
        idle: list[str] = []
        if heartbeat_timeout_s is not None:
            _rows, idle = views.worker_rows(session, heartbeat_timeout_s)
        if job_ids:
            jobs = [repo.get_job(session, job_id) for job_id in job_ids]
        else:
            jobs = list(repo.list_jobs(session, status))
        why = views.waiting_by_run(session, rt.teams, heartbeat_timeout_s) if heartbeat_timeout_s else {}
        return Snapshot(tuple(_line(job, idle, why) for job in jobs), tuple(idle))


def _table(snapshot: Snapshot) -> Table:
    table = Table("id", "status", "progress", "stage", "attempt", "retries", "cached", "source")
    for line in snapshot.lines:
        done = int(line.progress * 20)
        bar = "█" * done + "·" * (20 - done)
        table.add_row(str(line.job_id), line.status, f"{bar} {line.progress:.0%}", line.stage or "-",
                      str(line.attempt or "-"), str(line.retries), str(line.cached), markup_safe(line.source))
    if snapshot.warnings():
        table.caption = "\n".join(snapshot.warnings())
    return table


def watch_status(
    look: Callable[[Sequence[int] | None], Snapshot],
    every_s: float | None,
    is_tty: bool | None = None,
    echo: Callable[[str], None] = print,
) -> int:
    """Show the jobs once, or every `every_s` seconds until each watched job has finished.

    `look(job_ids)` takes a snapshot (None: every job the filter selects; the first look fixes
    which jobs are watched). Returns the exit code: 0, or 1 when a watched job failed or was
    cancelled.
    """
    is_tty = sys.stdout.isatty() if is_tty is None else is_tty
    snapshot = look(None)
    watched = [line.job_id for line in snapshot.lines]
    if not is_tty:
        return _watch_plain(look, snapshot, watched, every_s, echo)
    console = Console()
    if every_s is None or not watched:
        console.print(_table(snapshot))
        return _code(snapshot) if every_s is not None else 0
    from rich.live import Live

    with Live(_table(snapshot), console=console, refresh_per_second=4) as live:
        try:
            while not snapshot.is_done:
                time.sleep(every_s)
                snapshot = look(watched)
                live.update(_table(snapshot))
        except KeyboardInterrupt:
            return 130
    return _code(snapshot)


def _watch_plain(look: Callable[[Sequence[int] | None], Snapshot], snapshot: Snapshot, watched: list[int],
                 every_s: float | None, echo: Callable[[str], None]) -> int:
    if not snapshot.lines:
        echo("no jobs")
        return 0
    shown: dict[int, str] = {}
    warned: set[str] = set()
    while True:
        for line in snapshot.lines:
            text = line.plain()
            if shown.get(line.job_id) != text:
                echo(text)
                shown[line.job_id] = text
        for warning in snapshot.warnings():
            if warning not in warned:
                print(warning, file=sys.stderr, flush=True)
                warned.add(warning)
        sys.stdout.flush()
        if every_s is None:
            return 0
        if snapshot.is_done:
            return _code(snapshot)
        try:
            time.sleep(every_s)
        except KeyboardInterrupt:
            return 130
        snapshot = look(watched)


def _code(snapshot: Snapshot) -> int:
    return 0 if all(line.status == JobState.SUCCEEDED for line in snapshot.lines) else 1

