from __future__ import annotations

import pytest

from pipeline.core.errors import IllegalTransition
from pipeline.core.states import JobState, StageName, StageState, downstream_of, require


def test_normal_attempt_path_is_allowed() -> None:
    require(StageState.PENDING, StageState.QUEUED)
    require(StageState.QUEUED, StageState.RUNNING)
    require(StageState.RUNNING, StageState.SUCCEEDED)


@pytest.mark.parametrize("final", [StageState.SUCCEEDED, StageState.FAILED, StageState.SKIPPED_CACHED])
def test_final_stage_states_never_move(final: StageState) -> None:
    for target in StageState:
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
    assert len(downstream_of(StageName.DOWNLOAD)) == 7
