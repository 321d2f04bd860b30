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

__all__ = ["TensorReport", "build_report", "render_plot", "plot_font"]

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


def _common_exact_type(lossy: list[TensorReport]) -> str | None:
    """The finer type every inexact ternary tensor decodes exactly in, when they share one."""
    types = {r.exact_in for r in lossy if r.is_ternary}
    return types.pop() if len(types) == 1 and None not in types else None


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
    lossy = [r.name for r in rows if not r.exact]
    return {
        **header,
        # Lossless: every tensor written decodes to the source's values bit for bit, so the source's
        # own run can tell validation nothing the weights do not already prove.
        "exact": bool(rows) and not lossy,
        "n_inexact": len(lossy),
        "inexact_examples": lossy[:8],
        # A finer ternary type that every inexact tensor decodes exactly in (a ternary checkpoint with
        # one scale per 128 inputs is exact in Q2_0, not in TQ2_0): what the user should convert to.
        "exact_type": _common_exact_type([r for r in rows if not r.exact]),
        # The only loss is 16-bit rounding outside the ternary weights (a BF16 embedding stored as F16).
        "inexact_only_f16": bool(lossy) and all(not r.is_ternary and r.ggml_type == "F16"
                                                for r in rows if not r.exact),
        "tensors": [asdict(r) for r in rows],
        "layers": {str(k): _aggregate(v) for k, v in sorted(by_layer.items())},
        "totals": totals,
        "fallbacks": [
            {"name": r.name, "ggml_type": r.ggml_type, "reason": r.reason} for r in rows if r.is_fallback
        ],
    }


def render_plot(report: dict[str, Any]) -> bytes:
    """PNG bytes: per-layer sparsity (top, bars) and relative error vs absmean (bottom, lines).

    Drawn with Pillow (which matplotlib itself depends on): ~0.05 s, where importing
    matplotlib alone took ~0.6 s of every decompose run.
    """
    from PIL import Image, ImageDraw

    layers = sorted(report["layers"].items(), key=lambda kv: int(kv[0]))
    idx = [int(k) for k, _ in layers]
    sparsity = [v["sparsity"] for _, v in layers]
    err = [v["rel_error"] for _, v in layers]
    base = [v["absmean_rel_error"] for _, v in layers]
    image = Image.new("RGB", (_PLOT_W, _PLOT_H), "white")
    draw = ImageDraw.Draw(image)
    font = plot_font(13)
    title = f"{report.get('recipe', '')} {report.get('method', '')}: per-layer skeleton".strip()
    draw.text((_PLOT_W // 2, 8), title, fill="black", font=plot_font(15), anchor="mt")
    x_of = _x_axis(idx)
    top = _Panel(draw, font, 50, 250, (0.0, 1.0), "sparsity (zero codes)")
    for i, value in zip(idx, sparsity, strict=True):
        if _finite(value):
            x = x_of(i)
            draw.rectangle((x - _bar_half(idx), top.y(value), x + _bar_half(idx), top.y(0.0)), fill=_GREEN)
    values = [v for v in err + base if _finite(v)]
    bottom = _Panel(draw, font, 300, 500, (0.0, max(values, default=1.0) * 1.1 or 1.0), "relative error")
    for series, colour in ((base, _ORANGE), (err, _BLUE)):
        points = [(x_of(i), bottom.y(v)) for i, v in zip(idx, series, strict=True) if _finite(v)]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colour)
    for n, (colour, label) in enumerate(((_BLUE, str(report.get("method", "fit"))), (_ORANGE, "absmean"))):
        x = _PLOT_W - _RIGHT - 230 + 120 * n  # legend above the panel, right-aligned
        draw.line([(x, 290), (x + 25, 290)], fill=colour, width=3)
        draw.text((x + 31, 290), label, fill="black", font=font, anchor="lm")
    for i in _ticks(idx):
        draw.text((x_of(i), 506), str(i), fill="black", font=font, anchor="mt")
    draw.text((_PLOT_W // 2, 526), "block (layer) index", fill="black", font=font, anchor="mt")
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


_PLOT_W, _PLOT_H = 760, 550
_LEFT, _RIGHT = 80, 20
_GREEN, _BLUE, _ORANGE = (68, 170, 119), (31, 119, 180), (255, 127, 14)


def plot_font(size: int) -> Any:
    """Pillow's default font at ``size`` (the plots' only font: nothing to install)."""
    from PIL import ImageFont as image_font

    try:
        return image_font.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return image_font.load_default()


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _slot(idx: list[int]) -> float:
    # One slot per layer index from the lowest to the highest: a bar or point sits in its slot's
    # middle, so even one or two layers stay inside the frame.
    lo, hi = (min(idx), max(idx)) if idx else (0, 0)
    return (_PLOT_W - _LEFT - _RIGHT) / (hi - lo + 1)


def _x_axis(idx: list[int]) -> Any:
    lo = min(idx) if idx else 0
    slot = _slot(idx)
    return lambda i: _LEFT + (i - lo + 0.5) * slot


def _bar_half(idx: list[int]) -> float:
    return max(1.0, min(0.35 * _slot(idx), 40.0))


def _ticks(idx: list[int]) -> list[int]:
    step = max(1, -(-len(idx) // 12))
    return idx[::step]


class _Panel:
    """A framed plot area from y_top to y_bottom pixels with a linear value axis and tick labels."""

    def __init__(
        self, draw: Any, font: Any, y_top: int, y_bottom: int, limits: tuple[float, float], label: str
    ) -> None:
        self.y_top, self.y_bottom, (self.lo, self.hi) = y_top, y_bottom, limits
        draw.rectangle((_LEFT, y_top, _PLOT_W - _RIGHT, y_bottom), outline="black")
        for k in range(5):
            value = self.lo + (self.hi - self.lo) * k / 4
            y = self.y(value)
            draw.line([(_LEFT - 4, y), (_LEFT, y)], fill="black")
            draw.text((_LEFT - 7, y), f"{value:.2f}", fill="black", font=font, anchor="rm")
        draw.text((_LEFT, y_top - 6), label, fill="black", font=font, anchor="ls")

    def y(self, value: float) -> float:
        frac = (value - self.lo) / (self.hi - self.lo) if self.hi > self.lo else 0.0
        return self.y_bottom - frac * (self.y_bottom - self.y_top)
