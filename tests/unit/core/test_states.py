from __future__ import annotations

import pytest

from pipeline.core.errors import IllegalTransition
from pipeline.core.states import (
    STAGE_INPUTS,
    STAGE_ORDER,
    JobState,
    StageName,
    StageState,
    downstream_of,
    require,
    stage_inputs,
    topological_order,
)


def test_normal_attempt_path_is_allowed() -> None:
    require(StageState.PENDING, StageState.QUEUED)
    require(StageState.QUEUED, StageState.RUNNING)
    require(StageState.RUNNING, StageState.SUCCEEDED)


@pytest.mark.parametrize("final", [StageState.SUCCEEDED, StageState.FAILED, StageState.SKIPPED_CACHED])
def test_final_stage_states_never_move(final: StageState) -> None:
    # One exception: a failed attempt of a stage its readers turned out not to need (calibrate started
    # beside decompose) is recorded as not needed, its failure kept in its metrics.
    for target in StageState:
        if (final, target) == (StageState.FAILED, StageState.NOT_NEEDED):
            require(final, target)
            continue
        with pytest.raises(IllegalTransition, match=f"{final.value} -> {target.value}"):
            require(final, target)


def test_job_can_reopen_for_retry_but_not_skip_running() -> None:
    require(JobState.FAILED, JobState.RUNNING)
    with pytest.raises(IllegalTransition):
        require(JobState.PENDING, JobState.SUCCEEDED)


def test_mixed_kinds_are_refused() -> None:
    with pytest.raises(IllegalTransition, match="different kinds"):
        require(StageState.PENDING, JobState.RUNNING)


def test_downstream_of_keeps_pipeline_order() -> None:
    assert downstream_of(StageName.PACKAGE) == (StageName.PACKAGE, StageName.VALIDATE)
    assert downstream_of(StageName.DOWNLOAD)[0] is StageName.DOWNLOAD
    assert downstream_of(StageName.DOWNLOAD) == STAGE_ORDER


def test_a_job_graph_has_sensitivity_only_when_it_measures() -> None:
    plain = stage_inputs(decompose_reads_calibrate=False)
    assert StageName.SENSITIVITY not in plain
    assert plain[StageName.DECOMPOSE] == (StageName.DOWNLOAD, StageName.INSPECT)
    assert topological_order(plain) == tuple(s for s in STAGE_ORDER if s is not StageName.SENSITIVITY)
    # A retry from calibrate re-opens what the job runs, nothing it does not.
    assert StageName.SENSITIVITY not in downstream_of(StageName.CALIBRATE, plain)
    measured = stage_inputs(measures_sensitivity=True)
    assert measured == STAGE_INPUTS
    assert downstream_of(StageName.SENSITIVITY, measured) == (
        StageName.SENSITIVITY, StageName.DECOMPOSE, StageName.PACKAGE, StageName.VALIDATE)
    order = topological_order(measured)
    assert order.index(StageName.CALIBRATE) < order.index(StageName.SENSITIVITY) < order.index(
        StageName.DECOMPOSE)
