"""The sensitivity stage's contract: measured once per source and ladder (the budget is not in its
parameters), written and read back as one file, and applied only to the rungs it was measured on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.sensitivity import ChainStep, SensitivityStep, SensitivitySummary
from pipeline.stages import sensitivity
from pipeline.stages.base import JobSpec
from pipeline.stages.conversion.auto import Candidates
from pipeline.stages.conversion.sensitivity import apply_measured
from pipeline.ternary.allocate import Rung
from pipeline.ternary.sensitivity import depths_of, groups_of, lowered, step_bytes


def _ladder(costs: list[float]) -> list[Rung]:
    labels = [("Q2_0", 3, 18), ("Q4_K", None, 36), ("Q8_0", None, 68)]
    return [Rung(t, lv, n, c) for (t, lv, n), c in zip(labels, costs, strict=True)]


def _candidates() -> Candidates:
    rungs = {f"blk.{i}.ffn_up.weight": _ladder([9.0 - i / 2, 4.0 + i / 4, 1.0]) for i in range(6)}
    rungs["token_embd.weight"] = _ladder([6.0, 2.0, 0.5])
    return Candidates(rungs, {name: 32 for name in rungs})


def _measured(candidates: Candidates, rise: float = 0.25) -> SensitivitySummary:
    """What the stage would record for these candidates, with every step adding ``rise`` per depth."""
    rungs = candidates.rungs
    steps = []
    for group, names in groups_of(list(rungs)).items():
        base = lowered(rungs, names, 0)
        for depth in range(1, depths_of(rungs, names) + 1):
            there = lowered(rungs, names, depth)
            steps.append(SensitivityStep(
                group, depth, tuple(sorted({rungs[n][there[n]].label for n in names})),
                sum(rungs[n][base[n]].n_bytes - rungs[n][there[n]].n_bytes for n in names), 1.0,
                rise * depth, 0.9))
    return SensitivitySummary("calibration", 64, 0.01, 0.98, 1 + len(steps), 1.5, tuple(steps))


def test_the_summary_round_trips_and_a_foreign_file_names_the_fix(tmp_path: Path) -> None:
    summary = _measured(_candidates())
    summary.write(tmp_path / "sensitivity.json")
    assert SensitivitySummary.load(tmp_path / "sensitivity.json") == summary
    (tmp_path / "other.json").write_text('{"format": "decompose-report/1"}')
    with pytest.raises(IntegrityError, match="not a sensitivity/1 document.*retry the job from sensitivity"):
        SensitivitySummary.load(tmp_path / "other.json", "sensitivity/sensitivity.json")
    (tmp_path / "broken.json").write_text('{"format": "sensitivity/1", "steps": 3}')
    with pytest.raises(IntegrityError, match="not a valid measured sensitivity"):
        SensitivitySummary.load(tmp_path / "broken.json")


def test_measured_rises_become_the_candidates_costs() -> None:
    candidates = _candidates()
    costed = apply_measured(candidates, _measured(candidates, rise=0.25))
    embd = costed.rungs["token_embd.weight"]
    assert [r.cost for r in embd] == [0.5, 0.25, 0.0]  # its own group: the rises themselves
    assert [r.n_bytes for r in embd] == [r.n_bytes for r in candidates.rungs["token_embd.weight"]]
    pair = ("blk.0.ffn_up.weight", "blk.1.ffn_up.weight")  # one group of the three spans
    shares = [costed.rungs[n][1].cost for n in pair]
    assert sum(shares) == pytest.approx(0.25) and shares[0] < shares[1]  # shared by the proxy


def test_a_measurement_of_other_rungs_is_refused() -> None:
    candidates = _candidates()
    measured = _measured(candidates)
    refit = Candidates({**candidates.rungs, "token_embd.weight": _ladder([6.0, 0.4, 0.5])},
                       candidates.n_params)
    with pytest.raises(IntegrityError, match="measured on other rungs.*retry the job from sensitivity"):
        apply_measured(refit, measured)  # Q4_K is now off the hull: the embedding's steps differ
    with pytest.raises(IntegrityError, match="measured on other rungs"):
        apply_measured(candidates, replace(measured, steps=measured.steps[:-1]))
    # The chain must go down these rungs, each group's steps in order, to the bottom.
    rungs, groups = candidates.rungs, groups_of(list(candidates.rungs))
    chain = tuple(ChainStep(s.group, s.depth, step_bytes(rungs, groups[s.group], s.depth), 0.1, 0.9)
                  for s in measured.steps)
    assert apply_measured(candidates, replace(measured, chain=chain)).rungs.keys() == candidates.rungs.keys()
    for broken in (chain[1:], chain[::-1], (replace(chain[0], saved_bytes=1), *chain[1:])):
        with pytest.raises(IntegrityError, match="chain does not go down the rungs decompose fitted"):
            apply_measured(candidates, replace(measured, chain=broken))


def test_the_budget_and_the_quality_target_are_not_in_its_parameters() -> None:
    def params(**options: object) -> sensitivity.Params:
        return sensitivity.make_params(JobSpec("x", "auto", {"sensitivity": "measured", **options}))

    assert params(target_bpw=4.0) == params(target_bpw=6.0) == params(min_top1=0.6)
    assert params(fallback_type="F32") != params()  # what the files hold is
    assert params().importance == "imatrix"


def test_a_job_that_does_not_measure_is_refused_by_the_stage(tmp_path: Path) -> None:
    plain = sensitivity.make_params(JobSpec("x", "auto", {"sensitivity": "proxy"}))
    with pytest.raises(InputError, match="--option sensitivity=measured"):
        sensitivity.run(plain, {}, tmp_path)
