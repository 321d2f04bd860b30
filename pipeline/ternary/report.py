"""The decompose report: per-tensor rows, per-layer aggregates, model totals, and its PNG plot.

Pure data in, data out: `build_report` returns a JSON-ready dict, `render_plot` returns PNG
bytes. The stage writes both.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TensorReport", "build_report", "render_plot"]

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorReport:
    """One tensor's line in the report.

    ``sparsity`` (fraction of zero codes) and ``absmean_rel_error`` are None for non-ternary
    tensors; ``rel_error`` is ``||w - w_hat||_F / ||w||_F`` of the bytes written, for every type.
    ``sq_error`` / ``absmean_sq_error`` / ``sq_norm`` are the raw sums behind them (for aggregates).
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


def _ratio(num: float, den: float) -> float | None:
    if den <= 0.0:
        return None if num <= 0.0 else math.inf
    return math.sqrt(num / den)


def _aggregate(rows: list[TensorReport]) -> dict[str, Any]:
    """Sparsity, error and sizes over a group of tensors; errors weighted by ``||w||^2``."""
    tern = [r for r in rows if r.is_ternary]
    n_tern = sum(r.n_params for r in tern)
    n_params = sum(r.n_params for r in rows)
    n_bytes = sum(r.n_bytes for r in rows)
    return {
        "n_params": n_params,
        "n_ternary_params": n_tern,
        "n_bytes": n_bytes,
        "bits_per_weight": n_bytes * 8 / n_params if n_params else None,
        "sparsity": sum(r.n_zero for r in tern) / n_tern if n_tern else None,
        "rel_error": _ratio(sum(r.sq_error for r in tern), sum(r.sq_norm for r in tern)),
        "absmean_rel_error": _ratio(
            sum(r.absmean_sq_error or 0.0 for r in tern), sum(r.sq_norm for r in tern)
        ),
        "all_tensors_rel_error": _ratio(sum(r.sq_error for r in rows), sum(r.sq_norm for r in rows)),
    }


def build_report(rows: Iterable[TensorReport], header: dict[str, Any]) -> dict[str, Any]:
    """The report dict: ``header`` (method, device, recipe …) plus tensors, layers, totals, fallbacks.

    ``layers`` maps the block index (as a string, JSON keys) to the aggregates of its tensors;
    ``totals`` covers the whole model (``bits_per_weight`` = bytes × 8 / params over every
    tensor, ``ternary_bits_per_weight`` over ternary tensors only).
    """
    rows = list(rows)
    by_layer: dict[int, list[TensorReport]] = {}
    for row in rows:
        match = _BLOCK.match(row.name)
        if match:
            by_layer.setdefault(int(match.group(1)), []).append(row)
    totals = _aggregate(rows)
    tern = [r for r in rows if r.is_ternary]
    tern_params = sum(r.n_params for r in tern)
    tern_bytes = sum(r.n_bytes for r in tern)
    totals["ternary_bits_per_weight"] = tern_bytes * 8 / tern_params if tern_params else None
    totals["n_tensors"] = len(rows)
    totals["n_ternary"] = len(tern)
    totals["n_fallback"] = sum(1 for r in rows if r.is_fallback)
    return {
        **header,
        "tensors": [asdict(r) for r in rows],
        "layers": {str(k): _aggregate(v) for k, v in sorted(by_layer.items())},
        "totals": totals,
        "fallbacks": [
            {"name": r.name, "ggml_type": r.ggml_type, "reason": r.reason} for r in rows if r.is_fallback
        ],
    }


def render_plot(report: dict[str, Any]) -> bytes:
    """PNG bytes: per-layer sparsity (top) and relative error vs absmean (bottom)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers; must precede pyplot
    from matplotlib.figure import Figure

    layers = sorted(report["layers"].items(), key=lambda kv: int(kv[0]))
    idx = [int(k) for k, _ in layers]
    nan = float("nan")
    sparsity = [v["sparsity"] if v["sparsity"] is not None else nan for _, v in layers]
    err = [v["rel_error"] if v["rel_error"] is not None else nan for _, v in layers]
    base = [v["absmean_rel_error"] if v["absmean_rel_error"] is not None else nan for _, v in layers]
    fig = Figure(figsize=(8, 5.5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(idx, sparsity, color="#4a7")
    top.set_ylabel("sparsity (zero codes)")
    top.set_ylim(0, 1)
    top.set_title(f"{report.get('recipe', '')} {report.get('method', '')}: per-layer skeleton")
    bottom.plot(idx, err, "o-", label=f"{report.get('method', 'fit')}")
    bottom.plot(idx, base, "s--", label="absmean")
    bottom.set_ylabel("relative error")
    bottom.set_xlabel("block (layer) index")
    bottom.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()
