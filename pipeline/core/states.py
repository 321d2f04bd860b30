"""Job and stage-run states, and the table of moves between them.

The database stores each enum's value. `require(old, new)` is called by the
repository before every status write, so an illegal jump fails loudly instead of
leaving a row in a state nothing expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

from pipeline.core.errors import IllegalTransition

__all__ = [
    "StageName",
    "StageState",
    "JobState",
    "LinkDirection",
    "STAGE_INPUTS",
    "STAGE_ORDER",
    "DONE_STATES",
    "stage_inputs",
    "topological_order",
    "require",
    "downstream_of",
    "upstream_of",
]


class StageName(StrEnum):
    DOWNLOAD = "download"
    CHECKSUM = "checksum"
    INSPECT = "inspect"
    CALIBRATE = "calibrate"
    SENSITIVITY = "sensitivity"
    DECOMPOSE = "decompose"
    PACKAGE = "package"
    VALIDATE = "validate"


# The stage graph, declared once: which stages' outputs each stage reads (the cache key hashes exactly
# these). Every order shown to users, every retry set and the progress derive from it.
STAGE_INPUTS: Mapping[StageName, tuple[StageName, ...]] = MappingProxyType({
    StageName.DOWNLOAD: (),
    StageName.CHECKSUM: (StageName.DOWNLOAD,),
    StageName.INSPECT: (StageName.DOWNLOAD, StageName.CHECKSUM),
    StageName.CALIBRATE: (StageName.DOWNLOAD, StageName.INSPECT),
    # Only in the graph of a job whose auto recipe allocates on measured sensitivity (`stage_inputs`).
    StageName.SENSITIVITY: (StageName.DOWNLOAD, StageName.INSPECT, StageName.CALIBRATE),
    StageName.DECOMPOSE: (StageName.DOWNLOAD, StageName.INSPECT, StageName.CALIBRATE, StageName.SENSITIVITY),
    StageName.PACKAGE: (StageName.DOWNLOAD, StageName.INSPECT, StageName.DECOMPOSE),
    # The source's side of validation is calibrate's reference: validate never reads the source files.
    StageName.VALIDATE: (StageName.PACKAGE, StageName.DECOMPOSE, StageName.CALIBRATE),
})


def topological_order(inputs: Mapping[StageName, tuple[StageName, ...]],
                      defer: tuple[StageName, ...] = ()) -> tuple[StageName, ...]:
    """The stages so that each comes after all of its inputs; ties in declaration order, except that
    a stage in ``defer`` goes only when nothing else is ready."""
    order: list[StageName] = []
    while len(order) < len(inputs):
        ready = [s for s in StageName
                 if s in inputs and s not in order and all(i in order for i in inputs[s])]
        if not ready:
            raise ValueError(f"the stage graph has a cycle among {sorted(set(inputs) - set(order))}")
        order.append(next((s for s in ready if s not in defer), ready[0]))
    return tuple(order)


STAGE_ORDER: tuple[StageName, ...] = topological_order(STAGE_INPUTS)


def stage_inputs(*, decompose_reads_calibrate: bool = True,
                 measures_sensitivity: bool = False) -> Mapping[StageName, tuple[StageName, ...]]:
    """The graph one job runs by (known when the job is planned): `STAGE_INPUTS`, less the sensitivity
    stage unless its auto recipe allocates on measured costs, and less decompose's edge from calibrate
    when its recipe reads no statistics."""
    dropped = set() if measures_sensitivity else {StageName.SENSITIVITY}
    if not dropped and decompose_reads_calibrate:
        return STAGE_INPUTS
    graph = {stage: inputs for stage, inputs in STAGE_INPUTS.items() if stage not in dropped}
    if not decompose_reads_calibrate:
        dropped.add(StageName.CALIBRATE)
    graph[StageName.DECOMPOSE] = tuple(s for s in graph[StageName.DECOMPOSE] if s not in dropped)
    return MappingProxyType(graph)


class StageState(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED_CACHED = "skipped-cached"
    # Its only readers turned out not to need it (calibrate, when decompose proved the conversion
    # exact): recorded with the reason, no outputs; a retry from it runs it.
    NOT_NEEDED = "not-needed"

    @property
    def is_final(self) -> bool:
        return self in _FINAL_STAGE_STATES

    @property
    def is_done(self) -> bool:
        """Whether the stage no longer holds up what depends on it."""
        return self in DONE_STATES


_FINAL_STAGE_STATES = frozenset(
    {StageState.SUCCEEDED, StageState.FAILED, StageState.CANCELLED, StageState.SKIPPED_CACHED,
     StageState.NOT_NEEDED}
)
# The one "done" set: a stage in one of these states lets the stages after it run.
DONE_STATES = frozenset({StageState.SUCCEEDED, StageState.SKIPPED_CACHED, StageState.NOT_NEEDED})


class JobState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class LinkDirection(StrEnum):
    """Which way an artifact is linked to a stage run: read by it, or written."""

    IN = "in"
    OUT = "out"


_S = StageState
_STAGE_MOVES: dict[StageState, frozenset[StageState]] = {
    _S.PENDING: frozenset({_S.QUEUED, _S.RUNNING, _S.SKIPPED_CACHED, _S.CANCELLED, _S.FAILED, _S.NOT_NEEDED}),
    # queued -> queued is a re-dispatch of the same attempt by the reconciler.
    # queued -> not-needed: a stage started early whose readers turned out not to need it.
    _S.QUEUED: frozenset({_S.QUEUED, _S.RUNNING, _S.SKIPPED_CACHED, _S.CANCELLED, _S.FAILED, _S.NOT_NEEDED}),
    # running -> skipped-cached: the claimed attempt found an equal earlier result.
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.CANCELLED, _S.SKIPPED_CACHED}),
    _S.SUCCEEDED: frozenset(),
    # failed -> not-needed: a stage started early failed, then its readers turned out not to need it;
    # the failure moves into its metrics (the log stays), so a job that succeeded lists no failure.
    _S.FAILED: frozenset({_S.NOT_NEEDED}),
    _S.CANCELLED: frozenset(),
    _S.SKIPPED_CACHED: frozenset(),
    _S.NOT_NEEDED: frozenset(),
}

_J = JobState
_JOB_MOVES: dict[JobState, frozenset[JobState]] = {
    _J.PENDING: frozenset({_J.RUNNING, _J.CANCELLED, _J.FAILED}),
    _J.RUNNING: frozenset({_J.SUCCEEDED, _J.FAILED, _J.CANCELLED}),
    # A retry reopens a finished job; its earlier attempts stay recorded.
    _J.SUCCEEDED: frozenset({_J.RUNNING}),
    # Cancelling a failed job gives up on retrying it: `bonsai gc` may then take its bytes.
    _J.FAILED: frozenset({_J.RUNNING, _J.CANCELLED}),
    _J.CANCELLED: frozenset({_J.RUNNING}),
}


def require(old: StageState | JobState, new: StageState | JobState) -> None:
    """Raise IllegalTransition unless `old -> new` is in the transition table."""
    if isinstance(old, StageState) and isinstance(new, StageState):
        allowed: frozenset[StageState] | frozenset[JobState] = _STAGE_MOVES[old]
    elif isinstance(old, JobState) and isinstance(new, JobState):
        allowed = _JOB_MOVES[old]
    else:
        raise IllegalTransition(f"cannot compare states of different kinds: {old!r} -> {new!r}")
    if new not in allowed:
        raise IllegalTransition(f"illegal status change {old.value} -> {new.value}")


def upstream_of(stage: StageName, inputs: Mapping[StageName, tuple[StageName, ...]] = STAGE_INPUTS,
                ) -> tuple[StageName, ...]:
    """Every stage `stage` depends on in the graph ``inputs``, directly or through others, in
    `STAGE_ORDER`."""
    found: set[StageName] = set()
    pending = list(inputs[stage])
    while pending:
        item = pending.pop()
        if item not in found:
            found.add(item)
            pending.extend(inputs[item])
    return tuple(s for s in STAGE_ORDER if s in found)


def downstream_of(stage: StageName, inputs: Mapping[StageName, tuple[StageName, ...]] = STAGE_INPUTS,
                  ) -> tuple[StageName, ...]:
    """`stage` and every stage that depends on it in the graph ``inputs``, directly or through others,
    in `STAGE_ORDER`: what a retry from `stage` re-opens."""
    return tuple(s for s in STAGE_ORDER if s in inputs and (s == stage or stage in upstream_of(s, inputs)))
