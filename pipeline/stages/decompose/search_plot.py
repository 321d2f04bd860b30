"""The auto search's size-vs-agreement plot: each file tried, by size, in two panels (top-1, mean KL).

Drawn with Pillow like the sparsity plot; the chosen file is ringed, the target drawn as a dashed
line on its panel.
"""

from __future__ import annotations

import io

from pipeline.formats.decompose_report import SearchSummary
from pipeline.stages.decompose.report_plot import plot_font

__all__ = ["PLOT_NAME", "render_search_plot"]

PLOT_NAME = "candidates.png"
_W, _H, _LEFT, _RIGHT = 760, 520, 80, 30
_BLUE, _ORANGE, _RED, _GREY = (31, 119, 180), (255, 127, 14), (200, 30, 30), (150, 150, 150)


def render_search_plot(search: SearchSummary) -> bytes:
    """PNG bytes for the search of an allocation summary (`search.search`)."""
    from PIL import Image, ImageDraw

    trials = search.trials
    image = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(image)
    font = plot_font(13)
    targets = (("min_top1", search.min_top1), ("max_kl", search.max_kl))
    target = ", ".join(f"{k} {v}" for k, v in targets if v is not None)
    draw.text((_W // 2, 8), f"auto: files tried ({target}; scored on the {search.scored_on} text)",
              fill="black", font=plot_font(15), anchor="mt")
    sizes = [t.file_bytes / 1e6 for t in trials]
    lo, hi = float(min(sizes)), float(max(sizes))
    span = (hi - lo) or max(hi * 0.1, 1.0)
    lo, hi = lo - span * 0.08, hi + span * 0.08

    def x_of(mb: float) -> float:
        return float(_LEFT + (mb - lo) / (hi - lo) * (_W - _LEFT - _RIGHT))

    kls = [t.mean_kl for t in trials] + [search.max_kl or 0.0]
    panels = (
        ("top-1 agreement", "top1", (0.0, 1.0), 45, 235, _BLUE, search.min_top1),
        ("mean KL (nats)", "mean_kl", (0.0, max(kls) * 1.1 or 1.0), 280, 470, _ORANGE, search.max_kl),
    )
    for label, key, (v0, v1), top, bottom, colour, line in panels:
        draw.rectangle((_LEFT, top, _W - _RIGHT, bottom), outline="black")
        draw.text((_LEFT - 8, top), f"{v1:.3g}", fill="black", font=font, anchor="rt")
        draw.text((_LEFT - 8, bottom), f"{v0:.3g}", fill="black", font=font, anchor="rb")
        draw.text((_LEFT + 6, top + 4), label, fill="black", font=font, anchor="lt")

        def y_of(value: float, v0: float = v0, v1: float = v1, top: float = top,
                 bottom: float = bottom) -> float:
            return bottom - (min(max(value, v0), v1) - v0) / ((v1 - v0) or 1.0) * (bottom - top)

        if line is not None:
            y = y_of(float(line))
            for dash in range(_LEFT, _W - _RIGHT, 12):
                draw.line([(dash, y), (min(dash + 6, _W - _RIGHT), y)], fill=_GREY, width=1)
        for n, trial in enumerate(trials):
            x, y = x_of(trial.file_bytes / 1e6), y_of(float(getattr(trial, key)))
            fill = colour if trial.meets else _GREY
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=fill)
            if n == search.chosen:
                draw.ellipse((x - 8, y - 8, x + 8, y + 8), outline=_RED, width=2)
    for mb in (lo + span * 0.08, hi - span * 0.08):
        draw.text((x_of(mb), 476), f"{mb:.1f} MB", fill="black", font=font, anchor="mt")
    draw.text((_W // 2, 496), "file size (grey: misses the target; ringed: chosen)", fill="black", font=font,
              anchor="mt")
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()
