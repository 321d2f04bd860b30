"""Fan a stage out by source shard across workers, and join the shards back into one attempt.

A parent run (the stage attempt the coordinator sees) gets one child run per shard. Each
child is an ordinary stage run with `shard` set: it is claimed, cached, retried and
audited like any other. When the last child finishes, `join` merges their reports, links
their part files to the parent, and the parent succeeds; the job then moves on as usual.
Everything lives in the database, so a lost message or worker only delays the join: the
reconciler retries lost children and joins parents whose children all finished.

Used in distributed mode for decompose; embedded mode decomposes shards one after another.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.core.errors import IntegrityError
from pipeline.core.states import LinkDirection, StageState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.stages import load_stage
from pipeline.stages.base import InputFile, ShardOutput, Stage

__all__ = [
    "JoinOutcome", "shards_to_fan_out", "spawn_children", "latest_children", "settle_parent",
]

_ACTIVE = (StageState.PENDING, StageState.QUEUED, StageState.RUNNING)


@dataclass(frozen=True)
class JoinOutcome:
    """What a join decided: children to send again, and the parent's state when it became final."""

    retry_run_ids: list[int] = field(default_factory=list)
    parent_state: StageState | None = None


def shards_to_fan_out(module: Stage, params: Any, inputs: Mapping[str, InputFile]) -> tuple[str, ...]:
    """The shards the stage runs side by side for these params and inputs (its `FanOut`), else ()."""
    return module.FANOUT.shards(params, inputs) if module.FANOUT is not None else ()


def spawn_children(session: Session, parent: StageRun, shards: list[str]) -> list[int]:
    """One pending child run per shard; returns their ids (the caller sends them)."""
    children = [
        repo.new_attempt(session, parent.job, parent.stage, shard=shard, parent=parent)
        for shard in shards
    ]
    return [child.id for child in children]


def latest_children(session: Session, parent: StageRun) -> list[StageRun]:
    """The newest attempt of each shard of `parent`, in the order the shards were spawned."""
    children = session.scalars(
        select(StageRun).where(StageRun.parent_run_id == parent.id).order_by(StageRun.id)
    ).all()
    latest: dict[str, StageRun] = {}
    for child in children:
        latest[child.shard] = child
    return list(latest.values())


def settle_parent(session: Session, store: Any, parent_id: int, max_attempts: int,
         record: Any) -> JoinOutcome:
    """Decide on a parent whose children may all have finished.

    `record(session, parent, inputs, result)` stores and records the merged outputs (the
    shared execution path). Call it with the parent row locked by the caller's transaction.
    """
    parent = session.execute(
        select(StageRun).where(StageRun.id == parent_id).with_for_update()
    ).scalar_one()
    if parent.status != StageState.RUNNING:
        return JoinOutcome(parent_state=parent.status)
    children = latest_children(session, parent)
    if not children or any(child.status in _ACTIVE for child in children):
        return JoinOutcome()
    retry, fatal, is_retried_elsewhere = [], None, False
    for child in children:
        if child.status.is_done:
            continue
        if child.error_kind == "retryable" and child.attempt < max_attempts:
            again = repo.retry_attempt(session, child)
            if again is None:
                is_retried_elsewhere = True  # its one retry exists already: wait for that one
            else:
                retry.append(again.id)
        elif fatal is None:
            fatal = child
    if fatal is not None:
        repo.set_stage_state(session, parent, StageState.FAILED, error_kind=fatal.error_kind,
                             error_message=f"shard {fatal.shard}: {fatal.error_message}")
        return JoinOutcome(parent_state=StageState.FAILED)
    if retry or is_retried_elsewhere:
        return JoinOutcome(retry_run_ids=retry)
    _merge_into(store, parent, children, record, session)
    return JoinOutcome(parent_state=StageState.SUCCEEDED)


def _merge_into(
    store: Any, parent: StageRun, children: list[StageRun], record: Any, session: Session
) -> None:
    fan_out = load_stage(parent.stage).FANOUT
    if fan_out is None:
        raise IntegrityError(f"stage {parent.stage} has shard runs but does not fan out; retry the stage")
    inputs: dict[str, InputFile] = {}
    outputs: list[ShardOutput] = []
    for child in children:
        for link in child.links:
            if link.direction != LinkDirection.OUT:
                continue
            item = InputFile(link.name, store.path(link.artifact_sha256), link.artifact_sha256,
                             link.artifact.size_bytes)
            inputs[f"{parent.stage}[{child.shard}]/{link.name}"] = item
            outputs.append(ShardOutput(child.shard, item, link.artifact.kind, link.artifact.media_type))
    workdir = Path(tempfile.mkdtemp(prefix=f"join-run{parent.id}-"))
    try:
        record(session, parent, inputs, fan_out.join(outputs, [child.shard for child in children], workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
