from __future__ import annotations

from pipeline.core.states import (
    STAGE_INPUTS,
    STAGE_ORDER,
    StageName,
    StageState,
    stage_inputs,
    topological_order,
)
from pipeline.orchestration.coordinator import Frontier, frontier, progress, retry_stages

S = StageState


def _done_until(stage: StageName) -> dict[StageName, StageState]:
    return {s: S.SUCCEEDED for s in STAGE_ORDER[: STAGE_ORDER.index(stage)]}


def test_new_job_starts_with_download() -> None:
    assert frontier({}) == Frontier(ready=(StageName.DOWNLOAD,))


def test_cached_counts_as_done() -> None:
    latest = _done_until(StageName.INSPECT) | {StageName.CHECKSUM: S.SKIPPED_CACHED}
    assert frontier(latest).ready == (StageName.INSPECT,)


def test_failed_stage_stops_the_job() -> None:
    latest = _done_until(StageName.CHECKSUM) | {StageName.CHECKSUM: S.FAILED}
    assert frontier(latest) == Frontier(stopped=(StageName.CHECKSUM,))


def test_running_stage_means_wait_and_all_done_means_done() -> None:
    waiting = frontier(_done_until(StageName.PACKAGE) | {StageName.PACKAGE: S.RUNNING})
    assert waiting == Frontier(in_flight=(StageName.PACKAGE,)) and not waiting.done
    everything = {s: S.SUCCEEDED for s in STAGE_ORDER}
    assert frontier(everything).done
    assert progress(everything) == 1.0
    assert progress(_done_until(StageName.INSPECT)) == 2 / 8
    # A job without the sensitivity stage counts its own seven.
    assert progress(_done_until(StageName.INSPECT), topological_order(stage_inputs())) == 2 / 7


def test_every_stage_whose_inputs_are_done_is_ready_at_once() -> None:
    # Decompose reads no statistics: it and calibrate both wait only for inspect.
    graph = stage_inputs(decompose_reads_calibrate=False)
    after_inspect = _done_until(StageName.CALIBRATE)
    assert frontier(after_inspect, graph).ready == (StageName.CALIBRATE, StageName.DECOMPOSE)
    # The full graph keeps them in a line.
    assert frontier(after_inspect, STAGE_INPUTS).ready == (StageName.CALIBRATE,)
    # One running, the other failed: both are reported; package waits for decompose.
    mixed = after_inspect | {StageName.CALIBRATE: S.RUNNING, StageName.DECOMPOSE: S.FAILED}
    expected = Frontier(in_flight=(StageName.CALIBRATE,), stopped=(StageName.DECOMPOSE,))
    assert frontier(mixed, graph) == expected
    assert frontier(mixed, graph).current is StageName.CALIBRATE


def test_retry_defaults_to_first_unfinished_stage() -> None:
    latest = _done_until(StageName.DECOMPOSE) | {StageName.DECOMPOSE: S.FAILED}
    assert retry_stages(latest, None) == (StageName.DECOMPOSE, StageName.PACKAGE, StageName.VALIDATE)
    assert retry_stages(latest, StageName.VALIDATE) == (StageName.VALIDATE,)
    assert retry_stages({s: S.SUCCEEDED for s in STAGE_ORDER}, None) == ()
