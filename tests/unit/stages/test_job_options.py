"""The option table, and the one check every job input goes through (CLI, manifest, API) before a row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeline.calibration.probe import ProbeSpec
from pipeline.core.errors import InputError
from pipeline.orchestration.job_control import JobRequest, check_request, read_manifest
from pipeline.stages.options import KINDS, OPTIONS, canonical_recipe, check_job_input, job_warnings
from pipeline.stages.validate.params import DEFAULT_AGREEMENT_TEXT, Params
from pipeline.ternary.policy import RECIPES, Recipe


@pytest.mark.parametrize("spelled", ["tq2_0", "TQ2_0", "Tq2_0", " tq2-0 ", "MOSTLY_TQ2_0",
                                     "LLAMA_FTYPE_MOSTLY_TQ2_0"])
def test_recipe_names_in_any_case_and_llama_cpp_spellings(spelled: str) -> None:
    assert canonical_recipe(spelled) == "tq2_0"
    assert check_job_input(spelled, {}).recipe == "tq2_0"


def test_q_recipes_and_unknown_recipes() -> None:
    assert canonical_recipe("Q2_0") == "q2_0" and canonical_recipe("q1_0") == "q1_0"
    with pytest.raises(InputError, match=r"unknown recipe 'tq9'; did you mean 'tq2_0' or 'tq1_0'\? "
                                         r"known recipes: auto, q1_0, q2_0, tq1_0, tq2_0"):
        canonical_recipe("tq9")


def test_type_names_and_values_are_normalised() -> None:
    checked = check_job_input("tq2_0", {"embed_type": "f16", "output_type": "q8_0", "method": "AbsMean",
                                        "n_ctx": "512", "agreement_pass_kl": "0.2", "shards": "a.st, b.st"})
    assert checked.options == {"embed_type": "F16", "output_type": "Q8_0", "method": "absmean", "n_ctx": 512,
                               "agreement_pass_kl": 0.2, "shards": ["a.st", "b.st"]}
    # Text stays text: `--option expected=2` means the string "2".
    assert check_job_input(None, {"expected": "2"}).options == {"expected": "2"}


def test_unknown_option_key_is_refused_with_the_near_ones() -> None:
    with pytest.raises(InputError, match=r"unknown option 'metod'; did you mean 'method'\?"):
        check_job_input("tq2_0", {"metod": "absmean"})
    with pytest.raises(InputError, match="unknown option 'frobnicate'; `bonsai recipes` lists every option"):
        check_job_input("tq2_0", {"frobnicate": 1})


@pytest.mark.parametrize(("recipe", "options", "message"), [
    ("tq2_0", {"embed_type": "q4_k"},
     r"option embed_type='q4_k'; expected one of source, F16, BF16, F32, Q8_0"),
    ("tq2_0", {"n_ctx": "many"}, r"option n_ctx='many' must be an integer"),
    ("tq2_0", {"n_ctx": 8}, r"option n_ctx=8; expected at least 16"),
    ("tq2_0", {"irls_iters": 101}, r"expected at most 100"),
    ("tq2_0", {"levels": 4}, r"levels=4 applies to recipe q2_0 only"),
    ("q1_0", {"method": "absmax"}, r"method='absmax' for recipe 'q1_0'; expected one of optimal, absmean"),
    ("tq2_0", {"device": "gpu"}, r"option device='gpu'; expected auto, cpu, cuda or cuda:N"),
    ("tq2_0", {"prompt": 2}, r"option prompt=2 must be text"),
    ("tq2_0", {"target": "tpu"}, r"option target='tpu'; expected one of cpu, cuda, metal, vulkan"),
])
def test_bad_values_name_the_key_and_what_is_allowed(recipe: str, options: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(InputError, match=message):
        check_job_input(recipe, options)


def test_target_picks_the_default_recipe_and_warns_about_slow_types() -> None:
    assert check_job_input(None, {}).recipe == "tq2_0"
    assert check_job_input(None, {"target": "CUDA"}).recipe == "q2_0"
    assert check_job_input(None, {"target": "cpu"}) == check_job_input("tq2_0", {"target": "cpu"})
    assert check_job_input(None, {"target": "cuda"}).warnings == ()
    (warning,) = check_job_input("TQ2_0", {"target": "cuda"}).warnings
    assert warning.startswith("TQ2_0 has no kernel on cuda") and "'q2_0'" in warning
    (warning,) = check_job_input("q2_0", {"target": "cpu"}).warnings
    assert "scalar" in warning and "'tq2_0'" in warning
    assert job_warnings("tq2_0", {}) == []  # no target, no warning


def test_the_table_matches_the_stages_defaults() -> None:
    assert all(option.kind in KINDS for option in OPTIONS.values())
    params = Params()
    own = [field for field in dataclasses.fields(Params) if field.name not in ("recipe", "probe")]
    settings = [(params, field) for field in own]
    settings += [(params.probe, field) for field in dataclasses.fields(ProbeSpec)]
    for holder, field in settings:
        option = OPTIONS[field.name]  # every validate setting is a known option
        assert option.stage == "validate", field.name
        if option.default is not None:
            assert option.default == getattr(holder, field.name), field.name
    assert OPTIONS["agreement_text"].default is None and params.probe.agreement_text == DEFAULT_AGREEMENT_TEXT
    recipe = Recipe(name="x", ternary_type="TQ2_0")
    for field in dataclasses.fields(Recipe):
        if field.name not in ("name", "ternary_type", "target_bpw", "min_top1", "max_kl", "sensitivity"):
            assert OPTIONS[field.name].default == getattr(recipe, field.name), field.name
    # target_bpw is auto's alone: no table default, the recipe's own (named in the help).
    assert OPTIONS["target_bpw"].default is None and "4.0" in OPTIONS["target_bpw"].help
    assert RECIPES["auto"].target_bpw == 4.0
    # The quality targets are off unless given (0.0 in the recipe, no table default).
    assert OPTIONS["min_top1"].default is None and RECIPES["auto"].min_top1 == 0.0
    assert OPTIONS["max_kl"].default is None and not RECIPES["auto"].has_quality_target
    # auto measures its sensitivity unless told not to (or it has no imatrix): the help says so.
    assert OPTIONS["sensitivity"].default is None and "measured (the default" in OPTIONS["sensitivity"].help
    assert RECIPES["auto"].sensitivity == "measured" and recipe.sensitivity == "proxy"


def test_check_request_runs_the_stages_cross_checks_before_any_row() -> None:
    with pytest.raises(InputError, match="agreement_fail_top1"):
        check_request(JobRequest("./x", None, 0, {"agreement_pass_top1": "0.4",
                                                  "agreement_fail_top1": "0.6"}))
    # Calibrate's own reading: a calibration text that teaches the agreement text is refused now,
    # not three stages into the job.
    with pytest.raises(InputError, match="agreement"):
        check_request(JobRequest("./x", None, 0, {"importance": "imatrix",
                                                  "calibration_text": DEFAULT_AGREEMENT_TEXT}))
    checked = check_request(JobRequest("./x", "Q2_0", 0, {"embed_type": "bf16", "target": "cpu"}))
    assert (checked.recipe, checked.options["embed_type"]) == ("q2_0", "BF16")
    assert checked.warnings and "scalar" in checked.warnings[0]


def test_manifest_entries_are_checked_and_named(tmp_path: Path) -> None:
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  - org/a@main\n  - source: org/b@main\n    recipe: TQ1_0\n"
                        "    options: {embed_type: q8_0}\n  - source: org/c@main\n    target: cuda\n")
    a, b, c = read_manifest(manifest, None, 3, {"n_ctx": "128"})
    assert (a.recipe, a.priority, a.options) == ("tq2_0", 3, {"n_ctx": 128})
    assert (b.recipe, b.options) == ("tq1_0", {"n_ctx": 128, "embed_type": "Q8_0"})
    assert (c.recipe, c.options["target"]) == ("q2_0", "cuda")
    manifest.write_text("- org/a@main\n- source: org/b@main\n  options: {metod: absmean}\n")
    with pytest.raises(InputError, match=r"entry 2: unknown option 'metod'; did you mean 'method'\?"):
        read_manifest(manifest, None, 0)
    manifest.write_text("- source: org/b@main\n  recipie: tq2_0\n")
    with pytest.raises(InputError, match=r"entry 1: unknown keys \['recipie'\] \(did you mean 'recipe'\?\)"):
        read_manifest(manifest, None, 0)
