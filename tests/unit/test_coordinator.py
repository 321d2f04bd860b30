from __future__ import annotations

from pipeline.core.states import STAGE_ORDER, StageName, StageState
from pipeline.orchestration.coordinator import StepKind, next_step, progress, retry_stages

S = StageState


def _done_until(stage: StageName) -> dict[StageName, StageState]:
    return {s: S.SUCCEEDED for s in STAGE_ORDER[: STAGE_ORDER.index(stage)]}


def test_new_job_starts_with_download() -> None:
    decision = next_step({})
    assert decision.kind is StepKind.RUN and decision.stage is StageName.DOWNLOAD


def test_cached_counts_as_done() -> None:
    latest = _done_until(StageName.INSPECT) | {StageName.CHECKSUM: S.SKIPPED_CACHED}
    assert next_step(latest).stage is StageName.INSPECT


def test_failed_stage_stops_the_job() -> None:
    latest = _done_until(StageName.CHECKSUM) | {StageName.CHECKSUM: S.FAILED}
    decision = next_step(latest)
    assert decision.kind is StepKind.STOPPED and decision.stage is StageName.CHECKSUM


def test_running_stage_means_wait_and_all_done_means_done() -> None:
    assert next_step(_done_until(StageName.PACKAGE) | {StageName.PACKAGE: S.RUNNING}).kind is StepKind.WAIT
    everything = {s: S.SUCCEEDED for s in STAGE_ORDER}
    assert next_step(everything).kind is StepKind.DONE
    assert progress(everything) == 1.0
    assert progress(_done_until(StageName.INSPECT)) == 2 / 7


def test_retry_defaults_to_first_unfinished_stage() -> None:
    latest = _done_until(StageName.DECOMPOSE) | {StageName.DECOMPOSE: S.FAILED}
    assert retry_stages(latest, None) == (StageName.DECOMPOSE, StageName.PACKAGE, StageName.VALIDATE)
    assert retry_stages(latest, StageName.VALIDATE) == (StageName.VALIDATE,)
    assert retry_stages({s: S.SUCCEEDED for s in STAGE_ORDER}, None) == ()
