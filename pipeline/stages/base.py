"""The contract every stage follows: files and parameters in, files and numbers out.

A stage never touches the database, the broker or the environment. The caller
(embedded coordinator or a Celery task) gives it read-only input files and an empty
work folder; the stage writes its outputs inside that folder and returns a
`StageResult` naming them. The caller then stores each output by content hash.

Input and output files carry a logical *name*: a relative POSIX path such as
``config.json``, ``model-00001-of-00002.safetensors``, ``manifest.json`` or
``ternary/part-00001.safetensors``. Inputs from upstream stages are keyed
``"<stage>/<name>"`` (for example ``"download/config.json"``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pipeline.clients.hub import HubClient
    from pipeline.stages.sources import SourcePolicy

__all__ = [
    "InputFile",
    "JobSpec",
    "OutputFile",
    "StageResult",
    "SOURCE_REVISION_METRIC",
    "inputs_of",
    "Stage",
    "StageClients",
    "FanOut",
    "MemoryNeed",
    "no_memory_need",
    "input_size",
    "ShardOutput",
    "NO_CLIENTS",
    "every_input",
    "nothing_beyond_params",
    "DigestWitness",
]


@dataclass(frozen=True)
class InputFile:
    """One input artifact as the stage sees it: where it lies and what it must hash to."""

    name: str
    path: Path
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class OutputFile:
    """One file a stage wrote inside its work folder.

    `sha256` is set only for a file that is already stored under that digest (a fan-out
    join re-links its shards' parts): the store then skips re-reading it.
    """

    name: str
    path: Path
    kind: str
    media_type: str = "application/octet-stream"
    sha256: str | None = None


# The metric by which a stage tells the job what its source resolved to (download: a hub revision's
# commit); recorded on the job, from a fresh run or a reused one alike.
SOURCE_REVISION_METRIC = "resolved_revision"


@dataclass(frozen=True)
class StageResult:
    """What a stage hands back: its output files, its metrics and any warnings."""

    outputs: tuple[OutputFile, ...]
    metrics: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def inputs_of(inputs: Mapping[str, InputFile], stage: str) -> dict[str, InputFile]:
    """The inputs that came from one upstream stage, keyed by their own name."""
    prefix = f"{stage}/"
    return {key[len(prefix):]: item for key, item in inputs.items() if key.startswith(prefix)}


@dataclass(frozen=True)
class JobSpec:
    """What a job asked for, as stages see it when they build their parameters.

    `options` holds recipe knobs keyed by name (for example ``{"method": "optimal"}``);
    each stage picks the ones it understands and rejects nothing it does not.
    """

    source: str
    recipe: str = "tq2_0"
    options: Mapping[str, Any] = field(default_factory=dict)


class Stage(Protocol):
    """What every stage module provides; `pipeline.stages.STAGE_MODULES` is checked against it.

    ``make_params(job)``: the stage's typed parameters, checked (InputError names the option).
    ``select_inputs(params, inputs)``: the upstream outputs it reads for these params (the cache
    key and the recorded input links cover exactly those; `every_input` when it reads them all).
    ``cache_identity(params, clients)``: what beyond params and inputs decides its result ("" for
    nothing, `nothing_beyond_params`; None: never reuse). ``run(params, inputs, workdir, clients)``:
    ``inputs`` keyed ``"<stage>/<name>"``; ``workdir`` empty and the stage's own; ``clients`` the
    outside world it may use. ``FANOUT``: how it runs one shard per worker (`FanOut`), or None.
    ``memory_need(params, inputs)``: its peak memory as estimated from the model card and its
    inputs (`MemoryNeed`), or None when that does not grow with the model; a worker with a memory
    cap refuses a run it cannot hold before starting it.
    """

    NAME: str
    VERSION: str

    def make_params(self, job: JobSpec) -> Any: ...

    def select_inputs(self, params: Any, inputs: Mapping[str, InputFile]) -> Mapping[str, InputFile]: ...

    def cache_identity(self, params: Any, clients: StageClients) -> str | None: ...

    def run(
        self, params: Any, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = ...
    ) -> StageResult: ...

    def memory_need(self, params: Any, inputs: Mapping[str, InputFile]) -> MemoryNeed | None: ...

    @property
    def FANOUT(self) -> FanOut | None: ...  # noqa: N802 - a module constant, as the stages spell it


@dataclass(frozen=True)
class MemoryNeed:
    """About how much memory a stage's run will hold at its peak, and what makes that number."""

    n_bytes: int
    why: str


def no_memory_need(params: Any, inputs: Mapping[str, InputFile]) -> MemoryNeed | None:
    """`Stage.memory_need` of a stage whose memory does not grow with the model (None: no estimate)."""
    return None


def input_size(inputs: Mapping[str, InputFile], prefix: str) -> int:
    """The bytes of every input whose key starts with ``prefix`` (``"download/"``: the source's files)."""
    return sum(item.size_bytes for key, item in inputs.items() if key.startswith(prefix))


@dataclass(frozen=True)
class ShardOutput:
    """One file a shard's run wrote, as the join sees it: where it is stored and what it is."""

    shard: str
    file: InputFile
    kind: str
    media_type: str


@dataclass(frozen=True)
class FanOut:
    """How a stage runs one source shard per worker and joins the shards into one result.

    ``shards(params, inputs)``: the shards to run side by side (empty: run it whole).
    ``for_shard(params, shard)``: the params of one shard's run. ``join(outputs, shards, workdir)``:
    the stage's result from every shard's outputs (in shard order); an output passed through
    keeps its ``sha256`` so the store does not read it again.
    """

    shards: Callable[[Any, Mapping[str, InputFile]], tuple[str, ...]]
    for_shard: Callable[[Any, str], Any]
    join: Callable[[Sequence[ShardOutput], Sequence[str], Path], StageResult]


@dataclass(frozen=True)
class StageClients:
    """The outside world a stage may use, given by whoever runs it; each stage reads only its own.

    ``hub``: download's model hub (None: an anonymous client). ``source_policy``: the local folders
    a download may read (None: any). ``store_witness``: checksum's `DigestWitness`, the store that
    hashed the files it wrote (None: hash every file).
    """

    hub: HubClient | None = None
    source_policy: SourcePolicy | None = None
    store_witness: DigestWitness | None = None


NO_CLIENTS = StageClients()


def every_input(params: Any, inputs: Mapping[str, InputFile]) -> Mapping[str, InputFile]:
    """`Stage.select_inputs` of a stage that reads every upstream output it is given."""
    return inputs


def nothing_beyond_params(params: Any, clients: StageClients) -> str | None:
    """`Stage.cache_identity` of a stage whose result only its params and inputs decide."""
    return ""


class KnownDigest(Protocol):
    sha256: str
    size_bytes: int


@runtime_checkable
class DigestWitness(Protocol):
    """Who can vouch for the digest of a file it wrote itself (the artifact store), so nobody hashes
    it twice; passed to the checksum stage as its ``store_witness`` client."""

    def witnessed(self, path: Path) -> KnownDigest | None:
        """The digest computed from the bytes at `path` when they were written, if provably unchanged;
        None when the file is not one it wrote, or changed since: the caller hashes it then."""
        ...
