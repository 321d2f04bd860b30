"""The ``auto`` recipe's first pass: every candidate tensor on every rung of its ladder, then the choice.

Streams the source once (one tensor in memory at a time), fits or quantizes each candidate
tensor on each rung (`ternary.allocate.ladder`) and measures the importance-weighted error of
the bytes it would write; `ternary.allocate.allocate` then picks the types within
``target_bpw``. The second pass (the ordinary decompose) writes the chosen types. Every shard
of the card is measured, even when this run decomposes only some of them, so fanned-out shard
runs make the same choice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.formats.model_card import ModelCard
from pipeline.stages.decompose.calibration import CalibrationInputs
from pipeline.ternary.allocate import Rung, allocate, ladder
from pipeline.ternary.decompose import decompose_packed
from pipeline.ternary.pack import decode_bytes, encode_plain, tensor_nbytes
from pipeline.ternary.policy import LINEAR_KINDS, Recipe, TensorDecision, decide

__all__ = ["Allocation", "auto_decisions"]

log = logging.getLogger(__name__)

_HEADS = ("token_embd.weight", "output.weight")


@dataclass(frozen=True)
class Allocation:
    """The decisions and the evidence: every candidate's rungs and the budget they met."""

    decisions: dict[str, TensorDecision]
    summary: dict[str, Any]


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
    name: str, weight: torch.Tensor, device: torch.device, calibration: CalibrationInputs | None
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
        rungs.append(
            Rung(
                ggml_type, levels, tensor_nbytes(ggml_type, shape), _cost(weight, raw, ggml_type, importance)
            )
        )
    return rungs


def auto_decisions(
    source: Any,
    card: ModelCard,
    files: Mapping[str, Path],
    plan: list[Any],
    recipe: Recipe,
    device: torch.device,
    calibration: CalibrationInputs | None,
    stream_options: Mapping[str, Any],
) -> Allocation:
    """Decisions for every planned tensor under the auto recipe, and the allocation's summary."""
    decisions = {p.gguf_name: decide(p.gguf_name, p.shape, recipe) for p in plan}
    candidates: dict[str, list[Rung]] = {}
    for shard in card.shards:
        for name, weight in source.iter_tensors(card, files, shard, **stream_options):
            shape = tuple(int(d) for d in weight.shape)
            if _is_candidate(name, shape) and ladder(shape[1], name not in _HEADS):
                candidates[name] = _rungs(name, weight, device, calibration)
                log.debug(
                    "stage decompose: auto measured %s: %s",
                    name,
                    ", ".join(f"{r.label} {r.cost:.4g}" for r in candidates[name]),
                )
            del weight
    params = {name: int(np.prod(p.shape)) for p in plan for name in [p.gguf_name] if name in candidates}
    n_params = sum(params.values())
    budget = int(recipe.target_bpw * n_params / 8)
    chosen = allocate(candidates, budget)
    spent = sum(candidates[name][i].n_bytes for name, i in chosen.items())
    weighted = bool(calibration and calibration.imatrix)
    for name, index in chosen.items():
        rung = candidates[name][index]
        costs = ", ".join(f"{r.label} {r.cost:.3g}" for r in candidates[name])
        decisions[name] = TensorDecision(
            rung.ggml_type,
            rung.ggml_type == "Q2_0",
            f"{name}: auto chose {rung.label} ({rung.n_bytes * 8 / params[name]:.3g} bpw); "
            f"{'importance-weighted' if weighted else 'unweighted'} error by rung: {costs}",
            levels=rung.levels,
        )
    summary = {
        "target_bpw": recipe.target_bpw,
        "budget_bytes": budget,
        "spent_bytes": spent,
        "spent_bpw": round(spent * 8 / n_params, 4) if n_params else 0.0,
        "reachable": spent <= budget,
        "weighted": weighted,
        "candidates": {
            name: {
                "chosen": candidates[name][i].label,
                "rungs": [{"type": r.label, "n_bytes": r.n_bytes, "cost": r.cost} for r in candidates[name]],
            }
            for name, i in chosen.items()
        },
    }
    return Allocation(decisions, summary)
