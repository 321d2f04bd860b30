"""The ``auto`` recipe's first pass: every candidate tensor on every rung of its ladder, then the choice.

Streams the source once (one tensor in memory at a time), fits or quantizes each candidate
tensor on each rung (`ternary.allocate.ladder`) and measures the importance-weighted error of
the bytes it would write (the proxy). `choose` then picks the types within ``target_bpw``: the
first point of the sensitivity stage's measured chain that fits (`ternary.sensitivity`), or with
``sensitivity=proxy`` the allocator on the proxy (`ternary.allocate.allocate`). With ``min_top1``
/ ``max_kl``, decompose's `search` finds the smallest budget whose file meets them, reusing the
bytes kept here in a `RungBytes` scratch file. The second pass (the ordinary decompose) writes
the chosen types. Every shard of the card is measured, even
when this run decomposes only some of them, so fanned-out shard runs make the same choice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.formats.decompose_report import (
    AllocationSummary,
    CandidateSummary,
    RungCost,
)
from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.formats.model_card import ModelCard
from pipeline.formats.sensitivity import SensitivitySummary
from pipeline.stages.conversion.calibration import CalibrationInputs
from pipeline.ternary.allocate import Rung, allocate, ladder, rung_label
from pipeline.ternary.codecs import decompose_packed
from pipeline.ternary.pack import decode_bytes, encode_plain, tensor_nbytes
from pipeline.ternary.policy import LINEAR_KINDS, Recipe, TensorDecision, decide
from pipeline.ternary.sensitivity import along_chain, groups_of, predicted_kl

__all__ = ["Allocation", "Candidates", "RungBytes", "measure", "choose", "allocation_of", "budget_of",
           "label_of"]

log = logging.getLogger(__name__)

_HEADS = ("token_embd.weight", "output.weight")


@dataclass(frozen=True)
class Allocation:
    """The decisions and the evidence: every candidate's rungs and the budget they met."""

    decisions: dict[str, TensorDecision]
    summary: AllocationSummary


@dataclass
class Candidates:
    """Every candidate tensor's rungs (cheapest first) and parameter count, as measured."""

    rungs: dict[str, list[Rung]]
    n_params: dict[str, int]
    # With measured costs in ``rungs``: the rungs as fitted, whose hulls the measured chain goes down.
    fitted: dict[str, list[Rung]] | None = None

    @property
    def total_params(self) -> int:
        return sum(self.n_params.values())

    def bytes_range(self) -> tuple[int, int]:
        """The smallest and the largest file the ladders allow (every tensor cheapest / dearest)."""
        return (sum(min(r.n_bytes for r in rungs) for rungs in self.rungs.values()),
                sum(max(r.n_bytes for r in rungs) for rungs in self.rungs.values()))


class RungBytes:
    """Each rung's bytes, appended to one scratch file as measured, so a candidate file can be
    assembled again without refitting; memory holds one tensor's bytes at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._where: dict[tuple[str, str], tuple[int, int]] = {}
        self._handle = open(path, "w+b")  # noqa: SIM115 - closed by close()

    def put(self, name: str, label: str, raw: np.ndarray) -> None:
        offset = self._handle.seek(0, 2)
        self._handle.write(np.ascontiguousarray(raw).data)
        self._where[(name, label)] = (offset, int(raw.size))

    def get(self, name: str, label: str) -> np.ndarray | None:
        """The bytes kept for ``name`` on rung ``label``, or None when none were."""
        where = self._where.get((name, label))
        if where is None:
            return None
        self._handle.flush()
        raw = np.empty(where[1], np.uint8)
        self._handle.seek(where[0])
        self._handle.readinto(raw.data)
        return raw

    def close(self) -> None:
        self._handle.close()
        self.path.unlink(missing_ok=True)


def _is_candidate(name: str, shape: tuple[int, ...]) -> bool:
    if len(shape) != 2:
        return False
    return name in _HEADS or (name.startswith("blk.") and name.rsplit(".", 2)[-2] in LINEAR_KINDS)


def _cost(weight: torch.Tensor, raw: np.ndarray, ggml_type: str, importance: torch.Tensor | None) -> float:
    back = torch.from_numpy(decode_bytes(raw, ggml_type, tuple(weight.shape)))
    column_sq = ((weight.to(torch.float32) - back) ** 2).sum(dim=0, dtype=torch.float64)
    if importance is None:
        return float(column_sq.sum())
    return float((column_sq * importance.to(torch.float64)).sum())


def _rungs(
    name: str, weight: torch.Tensor, device: torch.device, calibration: CalibrationInputs | None,
    keep: RungBytes | None,
) -> list[Rung]:
    shape = tuple(int(d) for d in weight.shape)
    importance = calibration.importance(name, shape[1]) if calibration else None
    rungs = []
    for ggml_type, levels in ladder(shape[1], name not in _HEADS):
        if levels is not None:
            packed = decompose_packed(
                weight, ggml_type, "optimal", importance=importance, device=device, levels=levels
            )
            raw = packed.raw
        else:
            raw = encode_plain(
                weight.to(torch.float32), ggml_type, importance.numpy() if importance is not None else None
            )
        rung = Rung(ggml_type, levels, tensor_nbytes(ggml_type, shape),
                    _cost(weight, raw, ggml_type, importance))
        if keep is not None:
            keep.put(name, rung.label, raw)
        rungs.append(rung)
    return rungs


def measure(
    source: Any,
    card: ModelCard,
    files: Mapping[str, Path],
    plan: list[Any],
    device: torch.device,
    calibration: CalibrationInputs | None,
    stream_options: Mapping[str, Any],
    recipe: Recipe,
    keep: RungBytes | None = None,
) -> Candidates:
    """Every candidate tensor of every shard on every rung of its ladder. With ``keep``, every
    rung's bytes go there, and so do every other tensor's bytes under ``recipe``."""
    from pipeline.stages.conversion.shard import encode_tensor

    rungs: dict[str, list[Rung]] = {}
    dtypes = {p.gguf_name: p.source_dtype for p in plan}
    for shard in card.shards:
        for name, weight in source.iter_tensors(card, files, shard, **stream_options):
            shape = tuple(int(d) for d in weight.shape)
            if _is_candidate(name, shape) and ladder(shape[1], name not in _HEADS):
                rungs[name] = _rungs(name, weight, device, calibration, keep)
                log.debug(
                    "auto measured %s: %s",
                    name,
                    ", ".join(f"{r.label} {r.cost:.4g}" for r in rungs[name]),
                )
            elif keep is not None:
                decision = decide(name, shape, recipe, dtypes.get(name, ""))
                keep.put(name, label_of(decision), encode_tensor(name, weight, decision, recipe, device,
                                                                calibration))
            del weight
    n_params = {p.gguf_name: int(np.prod(p.shape)) for p in plan if p.gguf_name in rungs}
    return Candidates(rungs, n_params)


def choose(
    candidates: Candidates, plan: list[Any], recipe: Recipe, bpw: float, weighted: bool,
    sensitivity: SensitivitySummary | None = None,
) -> Allocation:
    """Decisions for every planned tensor with the candidates' types picked within ``bpw`` bits per
    weight over them. ``sensitivity``: the candidates' costs are measured KL (`measured_rungs`), and
    with its chain the types are the chain's first point that fits (`along_chain`)."""
    budget = budget_of(candidates, bpw)
    if sensitivity is None or not sensitivity.chain:
        return allocation_of(candidates, plan, recipe, allocate(candidates.rungs, budget), bpw, weighted,
                             sensitivity)
    rungs = candidates.fitted or candidates.rungs
    chosen, taken = along_chain(rungs, groups_of(list(rungs)), sensitivity.chain, budget)
    made = allocation_of(candidates, plan, recipe, chosen, bpw, weighted, sensitivity)
    point = sensitivity.chain[taken - 1].kl if taken else sensitivity.base_kl
    # The chain's file at this point was run: its KL is measured, not summed from single steps.
    return made if point is None else replace(made, summary=replace(made.summary, predicted_kl=point))


def allocation_of(
    candidates: Candidates, plan: list[Any], recipe: Recipe, chosen: Mapping[str, int], bpw: float,
    weighted: bool, sensitivity: SensitivitySummary | None = None,
) -> Allocation:
    """Decisions for every planned tensor, the candidates on the rungs ``chosen`` (index by name), as
    an allocation within ``bpw``."""
    budget = budget_of(candidates, bpw)
    decisions = {p.gguf_name: decide(p.gguf_name, p.shape, recipe, p.source_dtype) for p in plan}
    rungs, params = candidates.rungs, candidates.n_params
    n_params = candidates.total_params
    spent = sum(rungs[name][i].n_bytes for name, i in chosen.items())
    costs_are = ("measured KL (nats)" if sensitivity else
                 "importance-weighted error" if weighted else "unweighted error")
    for name, index in chosen.items():
        rung = rungs[name][index]
        costs = ", ".join(f"{r.label} {r.cost:.3g}" for r in rungs[name])
        decisions[name] = TensorDecision(
            rung.ggml_type,
            rung.ggml_type == GGMLTypeName.Q2_0,
            f"{name}: auto chose {rung.label} ({rung.n_bytes * 8 / params[name]:.3g} bpw); "
            f"{costs_are} by rung: {costs}",
            levels=rung.levels,
        )
    summary = AllocationSummary(
        target_bpw=round(bpw, 4),
        budget_bytes=budget,
        spent_bytes=spent,
        spent_bpw=round(spent * 8 / n_params, 4) if n_params else 0.0,
        reachable=spent <= budget,
        weighted=weighted,
        candidates={
            name: CandidateSummary(
                chosen=rungs[name][i].label,
                rungs=tuple(RungCost(type=r.label, n_bytes=r.n_bytes, cost=r.cost) for r in rungs[name]),
            )
            for name, i in chosen.items()
        },
        sensitivity=sensitivity,
        predicted_kl=round(predicted_kl(sensitivity.base_kl, rungs, chosen), 6) if sensitivity else None,
    )
    return Allocation(decisions, summary)


def label_of(decision: TensorDecision) -> str:
    """The `Rung.label` a decision stands for."""
    return rung_label(decision.ggml_type, decision.levels)


def budget_of(candidates: Candidates, bpw: float) -> int:
    """Bytes that ``bpw`` bits per weight buy over the candidate tensors."""
    return int(bpw * candidates.total_params / 8)
