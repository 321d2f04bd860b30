"""Stage sensitivity (between calibrate and decompose, only for ``auto`` with ``sensitivity=measured``).

Inputs: the card, the source shards, calibrate's importance matrix and its reference of the source.
Fits every candidate tensor on every rung of its ladder as decompose does (`conversion.auto`), then
runs in llama.cpp the base file (every candidate on the top of its hull), one file per group step,
and the measured chain (`conversion.sensitivity`), each scored against the source on the
calibration text. Writes ``sensitivity.json`` (`formats.sensitivity.SensitivitySummary`): every
step's KL rise, top-1, bytes and proxy, the chain, the base's figures, and what measuring took.

Nothing here depends on the budget or the quality target: the parameters are the recipe without
them, so the cache hands one measurement to every budget and every later job on the same source,
calibration and ladder. Decompose checks it was measured on the rungs it fitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.core.errors import InputError
from pipeline.formats.sensitivity import SENSITIVITY_NAME
from pipeline.stages.base import (
    NO_CLIENTS,
    InputFile,
    JobSpec,
    MemoryNeed,
    OutputFile,
    StageClients,
    StageResult,
    inputs_of,
)
from pipeline.stages.conversion.calibration import load_calibration, wanted_input
from pipeline.stages.conversion.inputs import fit_memory_need, load_card, resolve_device, source_module
from pipeline.stages.conversion.trial import TRIAL_POSITIONS
from pipeline.ternary.policy import AUTO, MEASURED, Recipe, get_recipe, importance_for

__all__ = ["NAME", "VERSION", "Params", "make_params", "select_inputs", "cache_identity", "memory_need",
           "run"]

NAME = "sensitivity"
VERSION = "2"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    """The recipe without its budget and quality target (they do not change what is measured), where
    the fit runs, the importance it is weighted by, and the calibration positions each file is scored on."""

    recipe: Recipe
    # decompose's and calibrate's options (declared there), read here too
    device: str = "auto"
    importance: str = "none"
    positions: int = TRIAL_POSITIONS


def make_params(job: JobSpec) -> Params:
    """Params from the job's recipe and options. Decompose checks ``device`` and the recipe's options
    when the job is submitted; any recipe is accepted here (only ``sensitivity=measured`` plans the stage)."""
    options = dict(job.options)
    recipe = get_recipe(job.recipe, options)
    budget_free = replace(recipe, target_bpw=0.0, min_top1=0.0, max_kl=0.0)
    return Params(recipe=budget_free, device=str(options.get("device", "auto")),
                  importance=str(importance_for(recipe.name, options)))


def select_inputs(params: Params, inputs: Mapping[str, InputFile]) -> dict[str, InputFile]:
    """The source, the card, and calibrate's importance matrix (as decompose weighs it) and reference."""
    return {key: item for key, item in inputs.items()
            if wanted_input(key, params.importance, params.recipe.method, reference=True)}


def cache_identity(params: Params, clients: StageClients = NO_CLIENTS) -> str | None:
    """The steps follow the allocator's hulls and the groups' spans: their versions."""
    from pipeline.ternary.allocate import ALLOCATOR_VERSION
    from pipeline.ternary.sensitivity import SPANS

    return f"allocator {ALLOCATOR_VERSION}; spans {SPANS}"


def memory_need(params: Params, inputs: Mapping[str, InputFile]) -> MemoryNeed | None:
    """As decompose's fit: a few float32 copies of the largest tensor (llama.cpp then maps one file)."""
    return fit_memory_need(inputs, NAME)


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    """Measure every group step; InputError when the recipe does not ask for it or an input is missing."""
    from pipeline.stages.conversion.auto import RungBytes, measure
    from pipeline.stages.conversion.calibration import load_reference
    from pipeline.stages.conversion.sensitivity import measure_steps
    from pipeline.stages.conversion.shard import stream_options
    from pipeline.stages.conversion.trial import TrialInputs

    started = time.monotonic()
    recipe = params.recipe
    if recipe.name != AUTO or recipe.sensitivity != MEASURED:
        raise InputError("the sensitivity stage measures the auto recipe with sensitivity=measured; this "
                         f"job's recipe is {recipe.name} with sensitivity={recipe.sensitivity}: submit it "
                         "with --recipe auto --option sensitivity=measured")
    device = resolve_device(params.device)
    card = load_card(inputs, NAME)
    source = source_module(card)
    files = {name: item.path for name, item in inputs_of(inputs, "download").items()}
    plan = source.tensor_plan(card)
    calibration = load_calibration(inputs, params.importance, recipe.method)
    reference = load_reference(inputs)
    kept = RungBytes(workdir / ".rungs.bin")
    try:
        candidates = measure(source, card, files, plan, device, calibration, stream_options(source), recipe,
                             kept)
        trials = TrialInputs(card, plan, recipe, candidates, kept, inputs, reference, workdir)
        measured = measure_steps(trials, bool(calibration and calibration.imatrix), params.positions)
    finally:
        kept.close()
    path = workdir / SENSITIVITY_NAME
    measured.write(path)
    log.info("stage sensitivity: %d steps over %d files in %.1f s (base KL %.4f)", len(measured.steps),
             measured.files, measured.seconds, measured.base_kl)
    metrics = {"sensitivity_steps": len(measured.steps), "sensitivity_files": measured.files,
               "sensitivity_s": measured.seconds, "base_kl": measured.base_kl,
               "elapsed_s": round(time.monotonic() - started, 3)}
    output = OutputFile(SENSITIVITY_NAME, path, "sensitivity-report", "application/json")
    return StageResult(outputs=(output,), metrics=metrics)
