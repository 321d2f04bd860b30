"""Join a decompose that fanned out by shard: many part reports in, one report and plot out.

Pure like every stage: the orchestration hands it the report.json of each shard's run and a
work folder. The part files themselves are not touched: each shard's run already wrote
and verified its own `ternary/part-XXXXX.safetensors`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.files import atomic_path, write_json
from pipeline.stages.base import OutputFile, StageResult
from pipeline.ternary.report import TensorReport, build_report, render_plot

__all__ = ["REPORT_NAME", "PLOT_NAME", "merge_part_reports", "finish_report"]

REPORT_NAME = "report.json"
PLOT_NAME = "sparsity.png"


def finish_report(
    rows: Sequence[TensorReport], header: Mapping[str, Any], workdir: Path
) -> tuple[list[OutputFile], dict[str, Any], tuple[str, ...]]:
    """Write report.json and sparsity.png for these tensors; returns outputs, metrics, warnings."""
    report = build_report(rows, dict(header))
    write_json(workdir / REPORT_NAME, report, indent=1, allow_nan=False)
    with atomic_path(workdir / PLOT_NAME) as tmp:
        tmp.write_bytes(render_plot(report))
    totals = report["totals"]
    metrics = {
        "sparsity": totals["sparsity"], "rel_error": totals["rel_error"],
        "absmean_rel_error": totals["absmean_rel_error"], "bpw": totals["bits_per_weight"],
        "ternary_bpw": totals["ternary_bits_per_weight"], "n_ternary": totals["n_ternary"],
        "n_fallback": totals["n_fallback"], "n_tensors": totals["n_tensors"], "n_bytes": totals["n_bytes"],
        "exact": report["exact"], "n_inexact": report["n_inexact"], "exact_type": report["exact_type"],
        "device": header.get("device"), "peak_rss_bytes": header.get("peak_rss_bytes"),
        "elapsed_s": header.get("elapsed_s"),
        # What the weights were before: a GGUF source's type histogram (Q4_K: 27, Q6_K: 9, ...).
        "source_format": header.get("source_format"), "source_types": header.get("source_types"),
    }
    outputs = [
        OutputFile(REPORT_NAME, workdir / REPORT_NAME, "decompose-report", "application/json"),
        OutputFile(PLOT_NAME, workdir / PLOT_NAME, "plot", "image/png"),
    ]
    warnings = tuple(f["reason"] for f in report["fallbacks"])
    if report["exact_type"]:
        warnings += (
            f"this conversion is lossy ({report['n_inexact']} tensor(s) do not decode to the source's "
            "values), "
            f"but the ternary weights decode exactly in {report['exact_type']} (one scale per 64 inputs): "
            f"--recipe {report['exact_type'].lower()} converts them without loss ({report['exact_type']} "
            "runs on CUDA, Metal and Vulkan; on x86 CPUs its kernel is scalar and slow)",)
    if report["inexact_only_f16"]:
        # A note, not a warning: F16 is the default that runs everywhere, and its rounding is tiny.
        metrics["exact_note"] = (
            "every ternary weight is exact, but storing " + ", ".join(report["inexact_examples"]) + " as F16 "
            "rounds some of their values; if the source stores them as BF16, embed_type=bf16 and "
            "output_type=bf16 keep them as stored and the conversion lossless")
    return outputs, metrics, warnings


def merge_part_reports(part_reports: Sequence[Path], shards: Sequence[str], workdir: Path) -> StageResult:
    """One report over every shard's tensors, in the card's shard order.

    Raises IntegrityError when the part reports disagree on the recipe or repeat a tensor.
    """
    reports = [json.loads(path.read_text(encoding="utf-8")) for path in part_reports]
    if not reports:
        raise IntegrityError("no shard reports to merge")
    keys = ("recipe", "ternary_type", "method", "irls_iters", "levels")
    recipes = {tuple(report.get(key) for key in keys) for report in reports}
    if len(recipes) != 1:
        raise IntegrityError(f"shard reports disagree on the recipe: {sorted(map(str, recipes))}")
    rows = [TensorReport(**tensor) for report in reports for tensor in report["tensors"]]
    names = [row.name for row in rows]
    if len(set(names)) != len(names):
        raise IntegrityError("shard reports name the same tensor twice; refusing to merge them")
    first = reports[0]
    header = {
        **{key: first.get(key) for key in keys},
        "format": first.get("format"),
        "device": ",".join(sorted({str(report.get("device")) for report in reports})),
        "shards": list(shards),
        # Wall time of the slowest shard: the shards ran side by side.
        "elapsed_s": max(float(report.get("elapsed_s") or 0.0) for report in reports),
        "peak_rss_bytes": max(int(report.get("peak_rss_bytes") or 0) for report in reports),
        "source_format": first.get("source_format"),
        "source_types": first.get("source_types"),
        "fanout": len(reports),
    }
    if first.get("allocation") is not None:
        header["allocation"] = first["allocation"]  # every shard's run made the same choice
    outputs, metrics, warnings = finish_report(rows, header, workdir)
    metrics["fanout"] = len(reports)
    return StageResult(outputs=tuple(outputs), metrics=metrics, warnings=warnings)
