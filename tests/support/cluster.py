"""A real distributed setup for integration tests: `bonsai worker` processes on real Redis and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from pipeline.db.models import Job, StageRun
from pipeline.db.session import make_engine, make_sessionmaker, session_scope
from tests.support.lossy_demo import LOSSY_ARGS

ROOT = Path(__file__).resolve().parents[2]

# Short clocks so lost workers and lost messages are noticed within seconds.
FAST_CLOCKS = {
    "BONSAI_HEARTBEAT_S": "0.5",
    "BONSAI_HEARTBEAT_TIMEOUT_S": "3",
    "BONSAI_RETRY_BASE_S": "0.2",
    "BONSAI_REQUEUE_AFTER_S": "2",
}


@dataclass
class Cluster:
    home: Path
    db_url: str
    broker_url: str
    extra_env: dict[str, str] = field(default_factory=dict)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = make_engine(self.db_url)
        self.sessions = make_sessionmaker(self.engine)

    @property
    def env(self) -> dict[str, str]:
        env = {**os.environ, **FAST_CLOCKS, **self.extra_env}
        env.update(BONSAI_HOME=str(self.home), BONSAI_DATABASE_URL=self.db_url,
                   BONSAI_BROKER_URL=self.broker_url)
        return env

    def bonsai(self, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipeline", *args], env={**self.env, **(env or {})},
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)

    def _spawn(self, args: Sequence[str], log_name: str, env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        log = open(self.home / log_name, "ab")  # noqa: SIM115 - closed with the process
        return subprocess.Popen([sys.executable, "-m", "pipeline", *args], env={**self.env, **(env or {})},
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_worker(self, queues: str = "io,cpu,gpu", **env: str) -> subprocess.Popen[bytes]:
        """A `bonsai worker`; `env` overrides this worker's variables (its own BONSAI_HOME, say)."""
        index = len(self.workers)
        proc = self._spawn(["worker", "--queues", queues, "--concurrency", "1",
                            "--hostname", f"w{index}@%h"], f"worker{index}.log", env)
        self.workers.append(proc)
        return proc

    def start_reconciler(self, every_s: float = 1.0) -> subprocess.Popen[bytes]:
        proc = self._spawn(["reconcile", "--every", str(every_s)], "reconcile.log")
        self.others.append(proc)
        return proc

    def submit(self, *sources: str, options: Sequence[str] = LOSSY_ARGS,
               team: str | None = None) -> list[int]:
        """Submit ``sources`` with ``options`` (CLI arguments) as ``team``; by default the demo's lossy
        route, which runs every stage (calibrate included), as most orchestration tests want."""
        result = self.bonsai("submit", *sources, *options, env={"BONSAI_TEAM": team} if team else None)
        assert result.returncode == 0, result.stdout + result.stderr
        return [int(line) for line in result.stdout.split()]

    def runs(self, **where: Any) -> list[StageRun]:
        with session_scope(self.sessions) as session:
            query = select(StageRun).order_by(StageRun.id)
            for name, value in where.items():
                query = query.where(getattr(StageRun, name) == value)
            return list(session.scalars(query).all())

    def jobs(self) -> list[Job]:
        with session_scope(self.sessions) as session:
            return list(session.scalars(select(Job).order_by(Job.id)).all())

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; logs in {self.home}")

    def wait_jobs_final(self, job_ids: Sequence[int], timeout_s: float) -> dict[int, str]:
        final = {"succeeded", "failed", "cancelled"}

        def done() -> bool:
            return all(job.status in final for job in self.jobs() if job.id in job_ids)

        self.wait_for(done, timeout_s, f"jobs {list(job_ids)} to finish")
        return {job.id: job.status for job in self.jobs() if job.id in job_ids}

    def kill_worker_running(self, pid: int) -> None:
        """SIGKILL the whole worker (main process and pool) whose pool child has `pid`."""
        for proc in self.workers:
            if proc.poll() is None and (proc.pid == pid or _parent_pid(pid) == proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                return
        raise AssertionError(f"no worker of this cluster runs pid {pid}")

    def stop(self) -> None:
        for proc in [*self.workers, *self.others]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [*self.workers, *self.others]:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.engine.dispose()


def _parent_pid(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1])


def store_is_clean(artifact_root: Path) -> list[str]:
    """Problems in the store: leftover temporary files, or files that do not hash to their name."""
    import hashlib

    problems = [f"leftover {p.name}" for p in (artifact_root / "tmp").iterdir()]
    for path in (artifact_root / "sha256").rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                if hashlib.file_digest(handle, "sha256").hexdigest() != path.name:
                    problems.append(f"{path.name} does not match its bytes")
    return problems
