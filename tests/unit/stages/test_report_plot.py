"""The decompose stage's PNG plot keeps every bar inside its frame, whatever the layer count."""

from __future__ import annotations

import io

import pytest

from pipeline.formats.decompose_report import Aggregate
from pipeline.stages.decompose import report_plot as report_module
from pipeline.stages.decompose.report_plot import render_plot


def _layers(n_layers: int) -> dict[int, Aggregate]:
    return {
        i: Aggregate(n_params=1, n_ternary_params=1, n_bytes=1, bits_per_weight=2.0, sparsity=0.3 + 0.01 * i,
                     rel_error=0.1, absmean_rel_error=0.3, all_tensors_rel_error=0.1)
        for i in range(n_layers)
    }


@pytest.mark.parametrize("n_layers", [1, 2, 3, 40])
def test_sparsity_bars_stay_inside_the_frame(n_layers: int) -> None:
    from PIL import Image

    image = Image.open(io.BytesIO(render_plot(_layers(n_layers), "tq2_0", "optimal"))).convert("RGB")
    width, _ = image.size
    green = report_module._GREEN
    left, right = report_module._LEFT, width - report_module._RIGHT
    # The top panel spans y 50..250; sample a row inside every bar (sparsity >= 0.3 reaches y < 190).
    row = [image.getpixel((x, 200)) for x in range(width)]
    columns = [x for x, pixel in enumerate(row) if pixel == green]
    assert columns, "bars are drawn"
    assert left < min(columns) and max(columns) < right, (min(columns), max(columns), left, right)
    # One separate bar per layer: count runs of green.
    runs = sum(1 for x in columns if x - 1 not in columns)
    assert runs == n_layers
