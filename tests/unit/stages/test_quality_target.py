"""The auto search's pieces that need no model: the target test, validate's confirmation, the plot."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from pipeline.formats.decompose_report import (
    AllocationSummary,
    DecomposeReport,
    ReportHeader,
    SearchSummary,
    SearchTrial,
)
from pipeline.stages.decompose.search import meets, top1_margin
from pipeline.stages.decompose.search_plot import render_search_plot
from pipeline.stages.validate.judge import Check, quality_target_check
from pipeline.ternary.policy import get_recipe


def _search(**target: Any) -> SearchSummary:
    trials = [
        {"target_bpw": 8.5, "spent_bpw": 8.5, "file_bytes": 300_000_000, "top1": 0.95, "mean_kl": 0.01,
         "meets": True, "seconds": 20.0},
        {"target_bpw": 3.9, "spent_bpw": 3.9, "file_bytes": 150_000_000, "top1": 0.30, "mean_kl": 1.2,
         "meets": False, "seconds": 18.0},
        {"target_bpw": 6.2, "spent_bpw": 6.1, "file_bytes": 200_000_000, "top1": 0.81, "mean_kl": 0.05,
         "meets": True, "seconds": 19.0},
    ]
    return SearchSummary(**{"min_top1": None, "max_kl": None, "top1_margin": None, **target},
                         scored_on="calibration", positions=900, met=True, chosen=2,
                         trials=tuple(SearchTrial(**trial) for trial in trials))


def _report(**more: Any) -> DecomposeReport:
    allocation = AllocationSummary(target_bpw=4.0, budget_bytes=1, spent_bytes=1, spent_bpw=4.0,
                                   reachable=True, weighted=False, candidates={}, **more)
    header = ReportHeader(recipe="auto", ternary_type="Q2_0", method="optimal", irls_iters=0, levels=3,
                          device="cpu", shards=("model.safetensors",), elapsed_s=1.0, peak_rss_bytes=None,
                          allocation=allocation)
    return DecomposeReport.build([], header)


def test_meets_needs_every_target_given() -> None:
    both = get_recipe("auto", {"min_top1": 0.6, "max_kl": 0.5})
    assert meets(both, 0.7, 0.4) and not meets(both, 0.7, 0.6) and not meets(both, 0.5, 0.1)
    assert meets(get_recipe("auto", {"max_kl": 0.5}), 0.0, 0.5)
    # The search's margin: 60.7 % over 1,022 positions is within noise of 60 %, 64 % is not.
    margin = top1_margin(0.6, 1022)
    assert 0.025 < margin < 0.035
    only_top1 = get_recipe("auto", {"min_top1": 0.6})
    assert meets(only_top1, 0.607, 9.9) and not meets(only_top1, 0.607, 9.9, margin)
    assert meets(only_top1, 0.64, 9.9, margin)


def test_validate_confirms_the_target_on_its_own_text() -> None:
    report = _report(search=_search(min_top1=0.6))
    measured = Check("agreement", "warn", "…", {"top1_agreement": 0.7, "mean_kl": 0.2})
    confirmed = quality_target_check(measured, report)
    assert confirmed is not None and confirmed.verdict == "pass"
    assert confirmed.numbers and confirmed.numbers["search_top1"] == 0.81
    short = quality_target_check(Check("agreement", "warn", "…", {"top1_agreement": 0.55, "mean_kl": 0.2}),
                                 report)
    assert short is not None and short.verdict == "fail" and "loosen the target" in short.reason
    empty = Check("agreement", "warn", "the agreement text option is empty")
    unmeasured = quality_target_check(empty, report)
    assert unmeasured is not None and unmeasured.verdict == "fail" and "not measured" in unmeasured.reason
    assert quality_target_check(measured, _report()) is None
    assert quality_target_check(measured, None) is None


def test_the_plot_is_a_png_of_the_trials() -> None:
    png = render_search_plot(_search(min_top1=0.6, max_kl=0.5))
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (760, 520)
    # Something is drawn in colour: the trials' dots and the ring of the chosen one.
    colours = {colour for _count, colour in image.convert("RGB").getcolors(maxcolors=1 << 20) or []}
    assert (200, 30, 30) in colours and (31, 119, 180) in colours
