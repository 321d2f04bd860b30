"""The decompose report (``decompose/report.json``): what decompose decided for every tensor and why.

The contract between decompose (which writes it, once per shard and once merged), validate
(which checks the file against it) and the page (which draws it). One dataclass tree, one
`load` (size-capped, IntegrityError naming the file) and one `write`; the JSON keeps the shape
it always had (header fields at the top, layers keyed by their index as text), so reports
already in a store still load. Keys are only ever added; a report from before a key existed
reads its default.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.files import write_json
from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.formats.jsonfile import ShapeError, as_dataclass, load_json
from pipeline.formats.sensitivity import SensitivitySummary

__all__ = [
    "REPORT_FORMAT", "REPORT_NAME", "TensorReport", "Aggregate", "Totals", "Fallback", "SearchTrial",
    "SearchSummary", "RungCost", "CandidateSummary",
    "AllocationSummary", "ImatrixUse", "ReportHeader", "DecomposeReport",
]

REPORT_FORMAT = "decompose-report/1"
REPORT_NAME = "report.json"
_MAX_BYTES = 64 * 1024 * 1024
_FIX = "retry the job from decompose (`bonsai retry JOB --from decompose`)"
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorReport:
    """One tensor's line in the report.

    ``sparsity`` (fraction of zero codes) and ``absmean_rel_error`` are None for non-ternary
    tensors; ``rel_error`` is ``||w - w_hat||_F / ||w||_F`` of the bytes written, for every type.
    ``sq_error`` / ``absmean_sq_error`` / ``sq_norm`` are the raw sums behind them (for aggregates).
    ``exact``: the bytes written decode to the source's values bit for bit (checked on the bytes,
    `ternary.exactness`); reports made before the check existed read as False.
    """

    name: str
    shape: list[int]
    ggml_type: str
    is_ternary: bool
    is_fallback: bool
    reason: str
    n_params: int
    n_bytes: int
    bits_per_weight: float
    rel_error: float
    sparsity: float | None
    absmean_rel_error: float | None
    sq_error: float
    absmean_sq_error: float | None
    sq_norm: float
    n_zero: int
    exact: bool = False
    # For a ternary tensor not exact in its type: a finer ternary type it decodes exactly in, if any.
    exact_in: str | None = None


@dataclass(frozen=True)
class Aggregate:
    """Sparsity, error and sizes over a group of tensors; errors weighted by ``||w||^2``."""

    n_params: int
    n_ternary_params: int
    n_bytes: int
    bits_per_weight: float | None
    sparsity: float | None
    rel_error: float | None
    absmean_rel_error: float | None
    all_tensors_rel_error: float | None

    @classmethod
    def over(cls, rows: list[TensorReport]) -> Aggregate:
        tern = [r for r in rows if r.is_ternary]
        n_tern = sum(r.n_params for r in tern)
        n_params = sum(r.n_params for r in rows)
        n_bytes = sum(r.n_bytes for r in rows)
        return cls(
            n_params=n_params,
            n_ternary_params=n_tern,
            n_bytes=n_bytes,
            bits_per_weight=n_bytes * 8 / n_params if n_params else None,
            sparsity=sum(r.n_zero for r in tern) / n_tern if n_tern else None,
            rel_error=_ratio(sum(r.sq_error for r in tern), sum(r.sq_norm for r in tern)),
            absmean_rel_error=_ratio(sum(r.absmean_sq_error or 0.0 for r in tern),
                                     sum(r.sq_norm for r in tern)),
            all_tensors_rel_error=_ratio(sum(r.sq_error for r in rows), sum(r.sq_norm for r in rows)),
        )


@dataclass(frozen=True)
class Totals(Aggregate):
    """The whole model: ``bits_per_weight`` over every tensor, ``ternary_bits_per_weight`` over the
    ternary ones only."""

    ternary_bits_per_weight: float | None = None
    n_tensors: int = 0
    n_ternary: int = 0
    n_fallback: int = 0


@dataclass(frozen=True)
class Fallback:
    """A tensor the recipe wanted ternary and could not have, and why."""

    name: str
    ggml_type: str
    reason: str


@dataclass(frozen=True)
class SearchTrial:
    """One file the auto search tried: its budget, what it spent, its size, and its agreement on
    the calibration text."""

    target_bpw: float
    spent_bpw: float
    file_bytes: int
    top1: float
    mean_kl: float
    meets: bool
    seconds: float
    # With measured sensitivity: the KL the allocation should have if its steps' rises add up.
    predicted_kl: float | None = None


@dataclass(frozen=True)
class SearchSummary:
    """The auto search's target and every trial; ``chosen`` indexes ``trials``."""

    min_top1: float | None
    max_kl: float | None
    scored_on: str
    positions: int
    top1_margin: float | None
    met: bool
    chosen: int
    trials: tuple[SearchTrial, ...]

    @property
    def best(self) -> SearchTrial:
        return self.trials[self.chosen]


@dataclass(frozen=True)
class RungCost:
    """One rung of a tensor's ladder: its type label, its bytes and its measured cost."""

    type: str
    n_bytes: int
    cost: float


@dataclass(frozen=True)
class CandidateSummary:
    """A tensor the auto recipe chose a type for: the rung taken and every rung measured."""

    chosen: str
    rungs: tuple[RungCost, ...]


@dataclass(frozen=True)
class AllocationSummary:
    """The auto recipe's budget, what it spent, each candidate's choice, and the search if one ran."""

    target_bpw: float
    budget_bytes: int
    spent_bytes: int
    spent_bpw: float
    reachable: bool
    weighted: bool
    candidates: Mapping[str, CandidateSummary]
    search: SearchSummary | None = None
    # Rung costs are in nats of measured KL when this is set, the proxy's otherwise.
    sensitivity: SensitivitySummary | None = None
    predicted_kl: float | None = None


@dataclass(frozen=True)
class ImatrixUse:
    """The importance matrix a conversion's fits were weighted by, as llama-quantize records it in the
    file (`formats.gguf.keys.QuantizeImatrix`): the file's name, its first dataset, entries, chunks."""

    file: str
    dataset: str
    entries_count: int
    chunks_count: int


@dataclass(frozen=True)
class ReportHeader:
    """How the tensors were made: the recipe, the machine, the time, and the source's formats."""

    recipe: str
    ternary_type: str | None
    method: str | None
    irls_iters: int | None
    levels: int | None
    device: str | None
    shards: tuple[str, ...]
    elapsed_s: float | None
    peak_rss_bytes: int | None
    source_format: str | None = None
    # What the weights were before: a GGUF source's type histogram (Q4_K: 27, Q6_K: 9, ...).
    source_types: Mapping[str, int] | None = None
    importance: str | None = None
    fit_backend: str | None = None
    # The number of shard runs merged into this report; None when one run made it.
    fanout: int | None = None
    allocation: AllocationSummary | None = None
    # Set when calibrate's imatrix weighted the fits; package writes it as quantize.imatrix.*.
    imatrix: ImatrixUse | None = None
    format: str = REPORT_FORMAT

    def recipe_key(self) -> tuple[Any, ...]:
        """What shard reports of one decompose must share to be merged."""
        return self.recipe, self.ternary_type, self.method, self.irls_iters, self.levels


@dataclass(frozen=True)
class DecomposeReport:
    """The header, every tensor's line, per-layer and whole-model aggregates, and the verdict on
    exactness. Build it with `build`; read it with `load`."""

    header: ReportHeader
    tensors: tuple[TensorReport, ...]
    # Block index -> the aggregates of its tensors.
    layers: Mapping[int, Aggregate]
    totals: Totals
    fallbacks: tuple[Fallback, ...]
    # Lossless: every tensor written decodes to the source's values bit for bit, so the source's
    # own run can tell validation nothing the weights do not already prove.
    exact: bool
    n_inexact: int
    inexact_examples: tuple[str, ...]
    # A finer ternary type that every inexact tensor decodes exactly in (a ternary checkpoint with
    # one scale per 128 inputs is exact in Q2_0, not in TQ2_0): what the user should convert to.
    exact_type: str | None
    # The only loss is 16-bit rounding outside the ternary weights (a BF16 embedding stored as F16).
    inexact_only_f16: bool
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, rows: Iterable[TensorReport], header: ReportHeader) -> DecomposeReport:
        rows = tuple(rows)
        by_layer: dict[int, list[TensorReport]] = {}
        for row in rows:
            match = _BLOCK.match(row.name)
            if match:
                by_layer.setdefault(int(match.group(1)), []).append(row)
        tern = [r for r in rows if r.is_ternary]
        tern_params = sum(r.n_params for r in tern)
        totals = Totals(
            **asdict(Aggregate.over(list(rows))),
            ternary_bits_per_weight=sum(r.n_bytes for r in tern) * 8 / tern_params if tern_params else None,
            n_tensors=len(rows),
            n_ternary=len(tern),
            n_fallback=sum(1 for r in rows if r.is_fallback),
        )
        lossy = [r for r in rows if not r.exact]
        return cls(
            header=header,
            tensors=rows,
            layers={k: Aggregate.over(v) for k, v in sorted(by_layer.items())},
            totals=totals,
            fallbacks=tuple(Fallback(r.name, r.ggml_type, r.reason) for r in rows if r.is_fallback),
            exact=bool(rows) and not lossy,
            n_inexact=len(lossy),
            inexact_examples=tuple(r.name for r in lossy[:8]),
            exact_type=_common_exact_type(lossy),
            inexact_only_f16=bool(lossy) and all(not r.is_ternary and r.ggml_type == GGMLTypeName.F16
                                                 for r in lossy),
        )

    def with_header(self, **changes: Any) -> DecomposeReport:
        return replace(self, header=replace(self.header, **changes))

    def to_document(self) -> dict[str, Any]:
        """The JSON object: header fields at the top level, as reports have always been written."""
        body = asdict(self)
        header, extra = body.pop("header"), body.pop("extra")
        body["layers"] = {str(k): v for k, v in body["layers"].items()}
        return {**header, **extra, **body}

    def write(self, path: Path) -> str:
        """Write the report atomically at `path`; returns the JSON text."""
        return write_json(path, self.to_document(), indent=1, allow_nan=False)

    @classmethod
    def from_document(cls, document: Any, label: str = REPORT_NAME) -> DecomposeReport:
        """The report in a parsed JSON document; IntegrityError naming `label` when it is not one."""
        _check_format(document, label)
        header_keys = {f.name for f in fields(ReportHeader)}
        body_keys = {f.name for f in fields(cls)} - {"header", "extra"}
        shaped = {
            "header": {k: v for k, v in document.items() if k in header_keys},
            **{k: v for k, v in document.items() if k in body_keys},
            "extra": {k: v for k, v in document.items() if k not in header_keys | body_keys},
        }
        try:
            return as_dataclass(cls, shaped)
        except ShapeError as exc:
            raise IntegrityError(f"{label}: not a valid decompose report ({exc}); {_FIX}") from None

    @classmethod
    def load(cls, path: Path, label: str = REPORT_NAME) -> DecomposeReport:
        """Read a report from `path` (at most 64 MB)."""
        document = load_json(path, label, max_bytes=_MAX_BYTES, error=IntegrityError, fix=_FIX)
        return cls.from_document(document, label)

    @staticmethod
    def load_imatrix_use(path: Path, label: str = REPORT_NAME) -> ImatrixUse | None:
        """Only the header's `ImatrixUse`, what package writes: shaping every tensor's line as `load`
        does costs a tenth of a second at 0.5B, more than the rest of package's bookkeeping."""
        document = load_json(path, label, max_bytes=_MAX_BYTES, error=IntegrityError, fix=_FIX)
        _check_format(document, label)
        value = document.get("imatrix")
        try:
            return None if value is None else as_dataclass(ImatrixUse, value)
        except ShapeError as exc:
            raise IntegrityError(f"{label}: not a valid decompose report ({exc}); {_FIX}") from None


def _check_format(document: Any, label: str) -> None:
    if not isinstance(document, Mapping) or document.get("format") != REPORT_FORMAT:
        raise IntegrityError(f"{label}: not a {REPORT_FORMAT} document; {_FIX}")


def _ratio(num: float, den: float) -> float | None:
    if den <= 0.0:
        return None if num <= 0.0 else math.inf
    return math.sqrt(num / den)


def _common_exact_type(lossy: list[TensorReport]) -> str | None:
    """The finer type every inexact ternary tensor decodes exactly in, when they share one."""
    types = {r.exact_in for r in lossy if r.is_ternary}
    return types.pop() if len(types) == 1 and None not in types else None
