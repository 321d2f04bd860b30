"""What a process that runs or starts stages holds, and the launcher contract it starts jobs through."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from pipeline.artifacts.store import ArtifactStore
from pipeline.core.teams import NO_TEAMS, Teams
from pipeline.stages.base import StageClients

__all__ = ["Runtime", "Launcher"]


class Launcher(Protocol):
    """Starts recorded jobs: runs them in this process (embedded) or sends them to workers (Celery)."""

    is_embedded: bool

    def start(self, job_id: int) -> None:
        """Run or dispatch the job's remaining stages (after submit, or after a retry)."""

    def revoke(self, task_ids: Sequence[str]) -> None:
        """Stop running tasks of a cancelled job (embedded runs notice by themselves)."""

    def shutdown(self) -> None:
        """Stop taking work; queued jobs stay pending in the database."""


@dataclass(frozen=True)
class Runtime:
    """What a process that runs stages holds: the database, the store, scratch space, clients."""

    sessions: sessionmaker[Session]
    store: ArtifactStore
    work_root: Path
    # host:pid, so an operator (or a test) can tell which process ran an attempt.
    worker_host: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # What the in-toto statements name as their builder: BONSAI_WORKER_NAME, else the host's name.
    worker_name: str = field(default_factory=socket.gethostname)
    # The outside world (the hub, the allowed source folders) every stage's run() is given.
    clients: StageClients = field(default_factory=StageClients)
    # Seconds between heartbeats of a running stage; the reconciler's timeout is larger.
    heartbeat_s: float = 10.0
    # A running attempt whose heartbeat is older than this is lost (the reconciler's rule); until
    # then an equal-key attempt waits for it instead of doing the same work twice.
    heartbeat_timeout_s: float = 120.0
    # Attempts of one stage before its job fails, and the first retry delay (doubling).
    max_attempts: int = 3
    retry_base_s: float = 5.0
    # Embedded mode: how many ready stages of one job run at once (BONSAI_STAGE_THREADS).
    stage_threads: int = 2
    stage_package: str = "pipeline.stages"
    # Ed25519 private key: when set, every statement is signed (DSSE) as it is recorded.
    signing_key: Any | None = None
    # A worker's cap on one attempt's process (BONSAI_WORKER_MEMORY_MB); None outside workers.
    memory_limit_bytes: int | None = None
    # BONSAI_SOURCE_ROOTS: the folders local sources must resolve into (empty: not confined).
    source_roots: tuple[str, ...] = ()
    # Distributed mode: sends shard child runs to workers; None decomposes shards in-process.
    fanout_dispatch: Callable[[list[int]], None] | None = None
    # How recorded jobs get run: in this process (embedded) or by Celery workers. Chosen once,
    # in `bootstrap.build_runtime`; the CLI and the API only ask it to start jobs.
    launcher: Launcher | None = None
    # Each team's share of the slots and its caps (BONSAI_TEAMS_FILE); the defaults cap nothing.
    teams: Teams = NO_TEAMS
