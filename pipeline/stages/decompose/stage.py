"""Stage 5, decompose: every eligible weight matrix becomes ternary codes with fp16 block scales.

Inputs: ``inspect/model_card.json`` and the source shards ``download/<name>`` (safetensors, or one
``.gguf`` file whose tensors are dequantized: `formats.gguf.tensor_source`); with
``importance=imatrix`` or ``method=gptq``, calibrate's importance or Gram matrices (`calibration`).
For each source shard (1-based index ``i`` in the card's shards) the stage writes
``ternary/part-<i:05d>.safetensors``
(`formats.parts`: GGUF-ready bytes keyed by GGUF name, with their index), streamed one tensor at
a time (`shard.decompose_shard`). Also ``report.json`` (`formats.decompose_report`) and
``sparsity.png``. Runs on CUDA when available (``device="auto"``).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import InputError
from pipeline.core.files import require_free_space
from pipeline.core.option_fields import option
from pipeline.formats.decompose_report import (
    AllocationSummary,
    DecomposeReport,
    ReportHeader,
    SearchSummary,
    TensorReport,
)
from pipeline.formats.model_card import ModelCard
from pipeline.formats.parts import PART_FORMAT, part_name
from pipeline.formats.sensitivity import RETRY_SENSITIVITY, SENSITIVITY_NAME, SensitivitySummary
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
from pipeline.stages.conversion.inputs import (
    device_fault,
    fit_memory_need,
    load_card,
    resolve_device,
    source_module,
)
from pipeline.stages.decompose.merge import FANOUT, PART_KIND, finish_report
from pipeline.ternary.policy import AUTO, MEASURED, Recipe, decide, get_recipe, importance_for

if TYPE_CHECKING:
    import torch

    from pipeline.formats.parts import PartIndex
    from pipeline.stages.conversion.auto import Allocation

__all__ = ["NAME", "VERSION", "PART_FORMAT", "FANOUT", "Params", "make_params", "select_inputs",
           "cache_identity", "memory_need", "run", "read_part_index", "part_name"]

NAME = "decompose"
VERSION = "1"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    """Decompose knobs: the recipe (see `policy.Recipe`), the device, and an optional shard subset.

    ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    ``shards``: names of the source shards to process (fan-out across workers); empty = all.
    ``importance``: "none", or "imatrix": weight each ternary fit by calibrate's importance matrix.
    """

    recipe: Recipe
    device: str = option("auto", help="where the fit runs: auto, cpu, cuda or cuda:N", check=device_fault)
    shards: tuple[str, ...] = option((), shown_default=None,
                                     help="only these safetensors shards (names; default: all)")
    # calibrate's option (declared there), read here too
    importance: str = "none"


def make_params(job: JobSpec) -> Params:
    """Params from the job's recipe name and options (``method``, ``irls_iters``, ``embed_type``, …,
    ``device``, ``shards``). Raises InputError for an unknown recipe or a bad option value."""
    options = dict(job.options)
    device = str(options.get("device", "auto"))
    why = device_fault(device)
    if why:
        raise InputError(f"option device={device!r}; {why}")
    shards = options.get("shards") or ()
    if isinstance(shards, str) or not all(isinstance(s, str) for s in shards):
        raise InputError(f"option shards={shards!r}; expected a list of shard file names")
    recipe = get_recipe(job.recipe, options)
    importance = importance_for(recipe.name, options)
    if importance not in ("none", "imatrix"):
        raise InputError(f"option importance={importance!r}; expected none or imatrix")
    if importance == "imatrix" and recipe.method not in ("optimal", "gptq"):
        raise InputError(f"option importance=imatrix weights the optimal fit; method={recipe.method!r} "
                         "ignores it: use method=optimal or drop importance")
    if recipe.reads_reference and importance == "none":
        raise InputError("min_top1 / max_kl and sensitivity=measured score files on the calibration text, "
                         "which calibrate runs the source over only for importance=imatrix (auto's "
                         "default): drop importance=none")
    return Params(recipe=recipe, device=device, shards=tuple(shards), importance=str(importance))


def memory_need(params: Params, inputs: Mapping[str, InputFile]) -> MemoryNeed | None:
    """Tensors stream one at a time: a few float32 copies of the largest one (source, fit, codes)."""
    return fit_memory_need(inputs, NAME)


def cache_identity(params: Params, clients: StageClients = NO_CLIENTS) -> str | None:
    """The auto recipe's result depends on the allocator's rules too: their version, for it. An
    imatrix-weighted report records the imatrix (`ImatrixUse`); reports from before it did are not reused."""
    from pipeline.ternary.allocate import ALLOCATOR_VERSION

    parts = [f"allocator {ALLOCATOR_VERSION}"] if params.recipe.name == AUTO else []
    parts += ["imatrix use 1"] if params.importance == "imatrix" else []
    return "; ".join(parts)


def select_inputs(params: Params, inputs: Mapping[str, InputFile]) -> dict[str, InputFile]:
    """Upstream outputs this recipe reads: calibrate's files only when importance or gptq asks."""
    return {key: item for key, item in inputs.items()
            if wanted_input(key, params.importance, params.recipe.method, params.recipe.has_quality_target)}


def read_part_index(path: Path, label: str | None = None) -> PartIndex:
    """The index of a part file, checked against its stored tensors; IntegrityError if it is not one."""
    from pipeline.stages.conversion.shard import read_part_index as read

    return read(path, label)


def _planned_bytes(shape: tuple[int, ...], ggml_type: str) -> int:
    from pipeline.ternary.pack import tensor_nbytes

    try:
        return tensor_nbytes(ggml_type, shape)
    except ValueError:
        return 0  # the shard's own plan check names this tensor, with the reason


def _fit_backend(recipe: Recipe, device: torch.device) -> str:
    """What fits the ternary tensors: the compiled CPU kernel (with its thread count) or torch."""
    import torch

    from pipeline.ternary import kernel

    optimal_uniform = recipe.method == "optimal" and recipe.irls_iters == 0
    if device.type == "cpu" and optimal_uniform and kernel.is_available():
        return f"kernel ({kernel.thread_count()} threads)"
    return f"torch ({device.type}, {torch.get_num_threads()} threads)"


def _measured(inputs: Mapping[str, InputFile]) -> SensitivitySummary:
    item = inputs.get(f"sensitivity/{SENSITIVITY_NAME}")
    if item is None:
        raise InputError(f"sensitivity=measured needs sensitivity/{SENSITIVITY_NAME}; inputs were "
                         f"{sorted(inputs)}; {RETRY_SENSITIVITY}")
    return SensitivitySummary.load(item.path, f"sensitivity/{SENSITIVITY_NAME}")


def _auto(
    card: ModelCard, files: Mapping[str, Path], plan: list[Any], recipe: Recipe, device: torch.device,
    calibration: Any, inputs: Mapping[str, InputFile], workdir: Path,
) -> Allocation:
    """The auto recipe's allocation: within target_bpw, or the smallest file meeting its quality target;
    on the sensitivity stage's measured costs with ``sensitivity=measured``."""
    from pipeline.stages.conversion.auto import RungBytes, choose, measure
    from pipeline.stages.conversion.sensitivity import apply_measured
    from pipeline.stages.conversion.shard import stream_options

    source = source_module(card)
    weighted = bool(calibration and calibration.imatrix)
    measured = _measured(inputs) if recipe.sensitivity == MEASURED else None
    if not recipe.has_quality_target:
        candidates = measure(source, card, files, plan, device, calibration, stream_options(source), recipe)
        if measured is not None:
            candidates = apply_measured(candidates, measured)
        return choose(candidates, plan, recipe, recipe.target_bpw, weighted, measured)
    from pipeline.stages.conversion.calibration import load_reference
    from pipeline.stages.conversion.trial import TrialInputs
    from pipeline.stages.decompose.search import search

    reference = load_reference(inputs)
    kept = RungBytes(workdir / ".rungs.bin")
    try:
        candidates = measure(source, card, files, plan, device, calibration, stream_options(source),
                             recipe, kept)
        if measured is not None:
            candidates = apply_measured(candidates, measured)
        return search(TrialInputs(card, plan, recipe, candidates, kept, inputs, reference, workdir), weighted,
                      measured)
    finally:
        kept.close()


def _target_text(recipe: Recipe) -> str:
    parts = [f"min_top1={recipe.min_top1:g}"] if recipe.min_top1 else []
    return " and ".join(parts + ([f"max_kl={recipe.max_kl:g}"] if recipe.max_kl else []))


def _search_plot(searched: SearchSummary, workdir: Path) -> OutputFile:
    from pipeline.core.files import atomic_path
    from pipeline.stages.decompose.search_plot import PLOT_NAME, render_search_plot

    with atomic_path(workdir / PLOT_NAME) as tmp:
        tmp.write_bytes(render_search_plot(searched))
    return OutputFile(PLOT_NAME, workdir / PLOT_NAME, "plot", "image/png")


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux: the high-water mark of this whole process, not just this stage.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    """Decompose every shard (or ``params.shards``) into part files, then write the report and plot.

    Raises InputError for a missing card or shard, an unsupported model (from the tensor plan),
    a value that does not fit its type; IntegrityError when the source disagrees with the card
    or a written part does not read back as planned. torch (through the shard code) loads
    here, not when the module is imported: choosing params and the cache key need no torch.
    """
    from pipeline.stages.conversion.shard import decompose_shard

    started = time.monotonic()
    device = resolve_device(params.device)
    card = load_card(inputs, NAME)
    files = {name: item.path for name, item in inputs_of(inputs, "download").items()}
    plan = source_module(card).tensor_plan(card)
    shards = list(card.shards)
    selected = list(params.shards) or shards
    unknown = [s for s in selected if s not in shards]
    missing = [s for s in selected if s not in files]
    if unknown or missing:
        raise InputError(f"shards {unknown or missing} are not in the card's shards {shards} or the inputs; "
                         "check the download and inspect outputs")
    recipe = params.recipe
    calibration = load_calibration(inputs, params.importance, recipe.method)
    decisions = {p.gguf_name: decide(p.gguf_name, p.shape, recipe, p.source_dtype) for p in plan}
    allocation: AllocationSummary | None = None
    if recipe.name == AUTO:
        chosen = _auto(card, files, plan, recipe, device, calibration, inputs, workdir)
        decisions, allocation = chosen.decisions, chosen.summary
        log.info("stage decompose: auto spends %.3f bpw of target %.3f over %d tensors",
                 allocation.spent_bpw, allocation.target_bpw, len(allocation.candidates))
    needed = sum(_planned_bytes(p.shape, decisions[p.gguf_name].ggml_type)
                 for p in plan if p.shard in selected)
    require_free_space(workdir, needed, f"the decomposed parts of {len(selected)} shard(s)")
    outputs: list[OutputFile] = []
    rows: list[TensorReport] = []
    for shard in selected:
        name = part_name(shards.index(shard) + 1)
        planned = [p for p in plan if p.shard == shard]
        log.info("stage decompose: shard %s (%d tensors) -> %s on %s", shard, len(planned), name, device)
        rows += decompose_shard(source_module(card), card, files, shard, workdir / name, planned, decisions,
                                recipe, device, calibration)
        outputs.append(OutputFile(name, workdir / name, PART_KIND))
    elapsed_s = time.monotonic() - started
    header = ReportHeader(
        recipe=recipe.name, ternary_type=recipe.ternary_type, method=recipe.method,
        irls_iters=recipe.irls_iters, levels=recipe.levels, importance=params.importance,
        device=str(device), fit_backend=_fit_backend(recipe, device), shards=tuple(selected),
        elapsed_s=round(elapsed_s, 3), peak_rss_bytes=_peak_rss_bytes(),
        source_format=card.format, source_types=dict(card.dtypes), allocation=allocation,
        imatrix=calibration.imatrix_use() if calibration is not None else None,
    )
    report_outputs, metrics, warnings = finish_report(DecomposeReport.build(rows, header), workdir)
    if allocation is not None:
        metrics["auto_bpw"] = allocation.spent_bpw
        # Each tensor's rung, so two jobs' allocations compare from the database (`bonsai show --against`).
        metrics["auto_types"] = {name: c.chosen for name, c in allocation.candidates.items()}
        searched = allocation.search
        if searched is not None:
            report_outputs.append(_search_plot(searched, workdir))
            best = searched.best
            metrics.update(auto_trials=len(searched.trials), auto_top1=best.top1, auto_kl=best.mean_kl)
            if not searched.met:
                warnings = (*warnings, f"no file within target_bpw={recipe.target_bpw} meets "
                            f"{_target_text(recipe)} on the calibration text (the largest tried: top-1 "
                            f"{best.top1:.1%}, KL {best.mean_kl:.3f}); it is kept for validate to "
                            "judge: loosen the target or raise target_bpw")
        elif not allocation.reachable:
            warnings = (*warnings, f"target_bpw={recipe.target_bpw} is below the smallest file the ladders "
                        f"allow ({allocation.spent_bpw} bpw): every tensor is at its cheapest type; "
                        "raise target_bpw")
    return StageResult(outputs=(*outputs, *report_outputs), metrics=metrics, warnings=warnings)
