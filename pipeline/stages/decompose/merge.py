"""Decompose fanned out by shard (`FANOUT`): one run per source shard, joined into one result.

Pure like every stage: the orchestration hands the join every shard's outputs and a work folder;
the report.json files are merged into one report and plot. The part files themselves are
passed through untouched: each shard's run already wrote and verified its own
`ternary/part-XXXXX.safetensors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.files import atomic_path
from pipeline.formats.decompose_report import REPORT_NAME, DecomposeReport
from pipeline.formats.model_card import CARD_NAME, ModelCard
from pipeline.stages.base import FanOut, InputFile, OutputFile, ShardOutput, StageResult
from pipeline.stages.decompose.report_plot import render_plot

__all__ = ["REPORT_NAME", "PLOT_NAME", "PART_KIND", "FANOUT", "merge_part_reports", "finish_report"]

PLOT_NAME = "sparsity.png"
PART_KIND = "ternary-part"


def finish_report(
    report: DecomposeReport, workdir: Path
) -> tuple[list[OutputFile], dict[str, Any], tuple[str, ...]]:
    """Write report.json and sparsity.png; returns outputs, metrics, warnings."""
    report.write(workdir / REPORT_NAME)
    header = report.header
    with atomic_path(workdir / PLOT_NAME) as tmp:
        tmp.write_bytes(render_plot(report.layers, header.recipe, header.method))
    totals = report.totals
    metrics = {
        "sparsity": totals.sparsity, "rel_error": totals.rel_error,
        "absmean_rel_error": totals.absmean_rel_error, "bpw": totals.bits_per_weight,
        "ternary_bpw": totals.ternary_bits_per_weight, "n_ternary": totals.n_ternary,
        "n_fallback": totals.n_fallback, "n_tensors": totals.n_tensors, "n_bytes": totals.n_bytes,
        "exact": report.exact, "n_inexact": report.n_inexact, "exact_type": report.exact_type,
        "device": header.device, "peak_rss_bytes": header.peak_rss_bytes,
        "elapsed_s": header.elapsed_s,
        "source_format": header.source_format,
        "source_types": dict(header.source_types) if header.source_types is not None else None,
    }
    outputs = [
        OutputFile(REPORT_NAME, workdir / REPORT_NAME, "decompose-report", "application/json"),
        OutputFile(PLOT_NAME, workdir / PLOT_NAME, "plot", "image/png"),
    ]
    warnings = tuple(f.reason for f in report.fallbacks)
    exact_type = report.exact_type
    if exact_type:
        warnings += (
            f"this conversion is lossy ({report.n_inexact} tensor(s) do not decode to the source's "
            "values), "
            f"but the ternary weights decode exactly in {exact_type} (one scale per 64 inputs): "
            f"--recipe {exact_type.lower()} converts them without loss ({exact_type} "
            "runs on CUDA, Metal and Vulkan; on x86 CPUs its kernel is scalar and slow)",)
    if report.inexact_only_f16:
        # A note, not a warning: F16 is the default that runs everywhere, and its rounding is tiny.
        metrics["exact_note"] = (
            "every ternary weight is exact, but storing " + ", ".join(report.inexact_examples) + " as F16 "
            "rounds some of their values; if the source stores them as BF16, embed_type=bf16 and "
            "output_type=bf16 keep them as stored and the conversion lossless")
    return outputs, metrics, warnings


def merge_part_reports(part_reports: Sequence[Path], shards: Sequence[str], workdir: Path) -> StageResult:
    """One report over every shard's tensors, in the card's shard order.

    Raises IntegrityError when a part report is unreadable, or the part reports disagree on the
    recipe or repeat a tensor.
    """
    reports = [DecomposeReport.load(path, f"a shard's {REPORT_NAME}") for path in part_reports]
    if not reports:
        raise IntegrityError("no shard reports to merge")
    recipes = {report.header.recipe_key() for report in reports}
    if len(recipes) != 1:
        raise IntegrityError(f"shard reports disagree on the recipe: {sorted(map(str, recipes))}")
    rows = [tensor for report in reports for tensor in report.tensors]
    names = [row.name for row in rows]
    if len(set(names)) != len(names):
        raise IntegrityError("shard reports name the same tensor twice; refusing to merge them")
    headers = [report.header for report in reports]
    # Every shard's run made the same allocation; the slowest shard's wall time is the stage's (the
    # shards ran side by side).
    merged = DecomposeReport.build(rows, reports[0].header).with_header(
        device=",".join(sorted({str(h.device) for h in headers})),
        shards=tuple(shards),
        elapsed_s=max(float(h.elapsed_s or 0.0) for h in headers),
        peak_rss_bytes=max(int(h.peak_rss_bytes or 0) for h in headers),
        fanout=len(reports),
    )
    outputs, metrics, warnings = finish_report(merged, workdir)
    metrics["fanout"] = len(reports)
    return StageResult(outputs=tuple(outputs), metrics=metrics, warnings=warnings)


def _shards(params: Any, inputs: Mapping[str, InputFile]) -> tuple[str, ...]:
    """The card's shards when there are two or more and the job did not pick some itself."""
    card_file = inputs.get(f"inspect/{CARD_NAME}")
    if card_file is None or params.shards:
        return ()
    shards = ModelCard.load(card_file.path, f"inspect/{CARD_NAME}").shards
    return tuple(str(shard) for shard in shards) if len(shards) >= 2 else ()


def _for_shard(params: Any, shard: str) -> Any:
    return replace(params, shards=(shard,))


def _join(outputs: Sequence[ShardOutput], shards: Sequence[str], workdir: Path) -> StageResult:
    parts = [OutputFile(o.file.name, o.file.path, o.kind, o.media_type, sha256=o.file.sha256)
             for o in outputs if o.kind == PART_KIND]
    reports = [o.file.path for o in outputs if o.file.name == REPORT_NAME]
    merged = merge_part_reports(reports, shards, workdir)
    return StageResult(outputs=(*parts, *merged.outputs), metrics=merged.metrics, warnings=merged.warnings)


FANOUT = FanOut(shards=_shards, for_shard=_for_shard, join=_join)
