"""A job's own stage graph and run order, decided when the job is planned (from its recipe).

Decompose reads calibrate's outputs only under recipes that ask for statistics (an importance
matrix, gptq's Gram matrices, a quality target). For every other recipe calibrate's only reader is
validate, and it needs the source's reference only when the conversion is lossy, which decompose
proves or refutes on the bytes it writes. Such a job runs calibrate last, after package, and only
when decompose found the conversion inexact (`calibrate_not_needed`); on one machine that spares
the source's whole llama.cpp run for every exact conversion.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.states import StageName, stage_inputs, topological_order

__all__ = ["JobPlan", "plan_for", "calibrate_not_needed"]


@dataclass(frozen=True)
class JobPlan:
    """``inputs``: the job's graph; ``order``: its run order; ``calibrate_if_lossy``: calibrate runs
    only for a conversion decompose found inexact."""

    inputs: Mapping[StageName, tuple[StageName, ...]]
    order: tuple[StageName, ...]
    calibrate_if_lossy: bool


def plan_for(recipe: str, options: Mapping[str, Any] | None) -> JobPlan:
    """The plan of a job with this recipe and these options (a recipe that cannot be read keeps the
    full graph: its stages report the fault)."""
    from pipeline.ternary.policy import reads_statistics

    try:
        reads = reads_statistics(recipe, dict(options or {}))
    except InputError:
        reads = True
    inputs = stage_inputs(decompose_reads_calibrate=reads)
    defer = () if reads else (StageName.CALIBRATE,)
    return JobPlan(inputs, topological_order(inputs, defer), calibrate_if_lossy=not reads)


def calibrate_not_needed(decompose_metrics: Mapping[str, Any] | None) -> str | None:
    """Why calibrate can be skipped, given decompose's finished attempt's metrics; None to run it."""
    if not decompose_metrics or decompose_metrics.get("exact") is not True:
        return None
    return ("not needed: decompose proved the conversion exact (every tensor's bytes decode to the "
            "source's values bit for bit; report.json), so validate runs the file alone")
