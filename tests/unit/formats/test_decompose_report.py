"""The decompose report is one typed contract: what decompose writes, validate and merge read back."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.core.errors import IntegrityError
from pipeline.formats.decompose_report import (
    AllocationSummary,
    CandidateSummary,
    DecomposeReport,
    ImatrixUse,
    ReportHeader,
    RungCost,
    SearchSummary,
    SearchTrial,
    TensorReport,
)
from pipeline.formats.sensitivity import SensitivityStep, SensitivitySummary


def _row(
    name: str, ggml_type: str = "TQ2_0", exact: bool = False, exact_in: str | None = None
) -> TensorReport:
    ternary = ggml_type.startswith(("TQ", "Q2_0"))
    return TensorReport(name=name, shape=[8, 256], ggml_type=ggml_type, is_ternary=ternary,
                        is_fallback=False, reason="", n_params=2048, n_bytes=528, bits_per_weight=2.0625,
                        rel_error=0.4, sparsity=0.3 if ternary else None,
                        absmean_rel_error=0.5 if ternary else None, sq_error=16.0,
                        absmean_sq_error=25.0 if ternary else None, sq_norm=100.0,
                        n_zero=614 if ternary else 0, exact=exact, exact_in=exact_in)


def _header(**more: object) -> ReportHeader:
    return ReportHeader(recipe="tq2_0", ternary_type="TQ2_0", method="optimal", irls_iters=0, levels=3,
                        device="cpu", shards=("model.safetensors",), elapsed_s=1.5, peak_rss_bytes=1 << 30,
                        **more)  # type: ignore[arg-type]


def test_a_written_report_loads_as_the_same_report(tmp_path: Path) -> None:
    search = SearchSummary(min_top1=0.6, max_kl=None, scored_on="calibration", positions=900,
                           top1_margin=0.03, met=True, chosen=1,
                           trials=(SearchTrial(6.0, 5.9, 300, 0.9, 0.1, True, 2.0),
                                   SearchTrial(3.0, 2.9, 200, 0.7, 0.3, True, 2.0, predicted_kl=0.25)))
    measured = SensitivitySummary(
        scored_on="calibration", positions=512, base_kl=0.006, base_top1=0.95, files=3, seconds=9.5,
        steps=(SensitivityStep("ffn_up[0-0]", 1, ("Q4_K",), 1, 8.0, 0.2, 0.9),
               SensitivityStep("ffn_up[0-0]", 2, ("Q2_0/3",), 2, 17.0, 1.1, 0.4)))
    allocation = AllocationSummary(target_bpw=6.0, budget_bytes=10, spent_bytes=9, spent_bpw=5.9,
                                   reachable=True, weighted=True,
                                   candidates={"blk.0.ffn_up.weight": CandidateSummary(
                                       "Q4_K", (RungCost("Q2_0/3", 1, 9.0), RungCost("Q4_K", 2, 1.0)))},
                                   search=search, sensitivity=measured, predicted_kl=0.206)
    rows = [_row("blk.0.ffn_up.weight"), _row("blk.1.ffn_up.weight", exact=True),
            _row("token_embd.weight", "F16", exact=True)]
    report = DecomposeReport.build(rows, _header(allocation=allocation))
    report.write(tmp_path / "report.json")
    loaded = DecomposeReport.load(tmp_path / "report.json")
    assert loaded == report
    assert loaded.header.allocation is not None and loaded.header.allocation.search is not None
    assert loaded.header.allocation.search.best.top1 == 0.7
    assert loaded.header.allocation.sensitivity == measured and loaded.header.allocation.predicted_kl == 0.206
    assert loaded.header.allocation.search.best.predicted_kl == 0.25
    assert set(loaded.layers) == {0, 1} and loaded.totals.n_tensors == 3
    assert not loaded.exact and loaded.n_inexact == 1 and loaded.inexact_examples == ("blk.0.ffn_up.weight",)
    # The JSON keeps the shape the page and older readers know: header at the top, layers by text.
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["recipe"] == "tq2_0" and set(document["layers"]) == {"0", "1"}
    assert document["allocation"]["search"]["trials"][1]["top1"] == 0.7


def test_exactness_and_the_finer_type_are_decided_from_the_rows() -> None:
    exact = DecomposeReport.build([_row("blk.0.attn_q.weight", exact=True)], _header())
    assert exact.exact and exact.exact_type is None and not exact.inexact_only_f16
    finer = DecomposeReport.build([_row("blk.0.attn_q.weight", exact_in="Q2_0")], _header())
    assert not finer.exact and finer.exact_type == "Q2_0"
    rounding = DecomposeReport.build([_row("blk.0.attn_q.weight", exact=True), _row("output.weight", "F16")],
                                     _header())
    assert rounding.inexact_only_f16 and rounding.exact_type is None
    assert not DecomposeReport.build([], _header()).exact, "no tensors prove nothing"


def test_an_older_report_reads_its_defaults_and_keeps_unknown_keys(tmp_path: Path) -> None:
    document = DecomposeReport.build([_row("blk.0.ffn_up.weight")], _header()).to_document()
    for key in ("importance", "fit_backend", "fanout", "allocation", "source_format", "source_types"):
        del document[key]
    for tensor in document["tensors"]:
        del tensor["exact"], tensor["exact_in"]
    document["written_by"] = "a later version"
    (tmp_path / "old.json").write_text(json.dumps(document))
    old = DecomposeReport.load(tmp_path / "old.json")
    assert old.header.importance is None and old.header.allocation is None
    assert old.tensors[0].exact is False and old.extra == {"written_by": "a later version"}
    assert old.to_document()["written_by"] == "a later version"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[1, 2]", "not a decompose-report/1 document"),
        ('{"format": "decompose-report/9"}', "not a decompose-report/1 document"),
        ('{"format": "decompose-report/1", "recipe": "tq2_0"}', "not a valid decompose report"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_broken_report_is_one_error_naming_the_file_and_the_fix(
    tmp_path: Path, text: str, says: str
) -> None:
    (tmp_path / "report.json").write_text(text)
    with pytest.raises(IntegrityError) as raised:
        DecomposeReport.load(tmp_path / "report.json", "decompose/report.json")
    message = str(raised.value)
    assert message.startswith("decompose/report.json: ") and says in message
    assert "retry the job from decompose" in message and "Traceback" not in message


def test_a_wrong_value_names_where_it_is(tmp_path: Path) -> None:
    document = DecomposeReport.build([_row("blk.0.ffn_up.weight")], _header()).to_document()
    document["tensors"][0]["n_params"] = "many"
    (tmp_path / "report.json").write_text(json.dumps(document))
    with pytest.raises(IntegrityError, match=r"tensors\.0\.n_params"):
        DecomposeReport.load(tmp_path / "report.json")


def test_with_header_changes_only_the_header() -> None:
    report = DecomposeReport.build([_row("blk.0.ffn_up.weight")], _header())
    merged = report.with_header(fanout=2, shards=("a", "b"))
    assert merged.header == replace(report.header, fanout=2, shards=("a", "b"))
    assert merged.tensors == report.tensors and merged.totals == report.totals


def test_the_imatrix_a_report_records_reads_back_alone(tmp_path: Path) -> None:
    use = ImatrixUse(file="imatrix.gguf", dataset="builtin", entries_count=14, chunks_count=9)
    DecomposeReport.build([_row("blk.0.ffn_up.weight")], _header(imatrix=use)).write(tmp_path / "a.json")
    assert DecomposeReport.load_imatrix_use(tmp_path / "a.json") == use
    assert DecomposeReport.load(tmp_path / "a.json").header.imatrix == use
    DecomposeReport.build([_row("blk.0.ffn_up.weight")], _header()).write(tmp_path / "b.json")
    assert DecomposeReport.load_imatrix_use(tmp_path / "b.json") is None
    document = json.loads((tmp_path / "a.json").read_text())
    document["imatrix"] = {"file": "imatrix.gguf"}
    (tmp_path / "c.json").write_text(json.dumps(document))
    with pytest.raises(IntegrityError, match="c.json: not a valid decompose report"):
        DecomposeReport.load_imatrix_use(tmp_path / "c.json", "c.json")
