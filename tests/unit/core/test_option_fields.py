"""Options declared on the fields that hold them: the table, the reader and the bounds from one place."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeline.core.errors import InputError
from pipeline.core.option_fields import declared, option, read_fields


@dataclass(frozen=True)
class _Knobs:
    size: int = option(8, help="how many", low=1, high=64)
    mode: str = option("fast", help="which way", choices=("fast", "slow"))
    top_k: int = option(4, key="reference_top_k", help="kept per position", low=1)
    note: str = option("built in", shown_default=None, help="worked out when not given")
    names: tuple[str, ...] = option((), help="a list")
    internal: bool = False  # not an option: no declaration


def test_declared_lists_each_option_with_its_key_kind_and_shown_default() -> None:
    rows = {row.key: row for row in declared(_Knobs)}
    assert list(rows) == ["size", "mode", "reference_top_k", "note", "names"]
    assert rows["reference_top_k"].field_name == "top_k" and rows["reference_top_k"].kind == "int"
    assert rows["note"].default is None and rows["size"].default == 8 and rows["names"].kind == "list"
    assert rows["mode"].doc.choices == ("fast", "slow")


def test_read_fields_reads_by_key_and_holds_values_to_the_declaration() -> None:
    read = read_fields(_Knobs, {"size": "16", "reference_top_k": 9, "other": 1}, "demo")
    assert read == {"size": 16, "top_k": 9}
    with pytest.raises(InputError, match=r"demo option size=65 is out of range: expected at most 64"):
        read_fields(_Knobs, {"size": 65}, "demo")
    with pytest.raises(InputError, match=r"demo option mode='slower'; expected one of fast, slow"):
        read_fields(_Knobs, {"mode": "slower"}, "demo")
    with pytest.raises(InputError, match=r"option reference_top_k=0 is out of range: expected at least 1"):
        read_fields(_Knobs, {"reference_top_k": 0}, "demo")


def test_the_job_options_table_is_the_stages_declarations() -> None:
    from pipeline.calibration.probe import ProbeSpec
    from pipeline.stages.calibrate.params import Params as CalibrateParams
    from pipeline.stages.options import OPTIONS

    # The bounds the table checks at submit are the ones the stage holds its own fields to.
    row = OPTIONS["calibration_ctx"]
    expected = ("calibrate", 16, 8192, CalibrateParams().calibration_ctx)
    assert (row.stage, row.low, row.high, row.default) == expected
    assert OPTIONS["n_ctx"].low == next(r.doc.low for r in declared(ProbeSpec) if r.key == "n_ctx")
    with pytest.raises(InputError, match="calibration_ctx=9000 is out of range"):
        read_fields(CalibrateParams, {"calibration_ctx": 9000}, "calibrate")
