"""The auto recipe end to end on a float checkpoint: the budget holds, more budget buys less error,
and the llama.cpp-quantized tensors in the GGUF are that quantizer's own bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.calibration.imatrix import read_imatrix
from pipeline.core.settings import Settings
from pipeline.core.states import JobState
from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.demo import write_demo_checkpoint
from pipeline.formats.gguf.ggml_quantize import LLAMA_QUANT_TYPES, quantize
from pipeline.formats.gguf.keys import QuantizeImatrix
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo llama with Gaussian linear weights (not ternary already): what auto is for."""
    folder = write_demo_checkpoint(tmp_path_factory.mktemp("float") / "ck")
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name, value in tensors.items():
        if name.endswith("_proj.weight"):
            scale = 0.3 if "layers.1.mlp" in name else 0.05  # one block matters more than the rest
            tensors[name] = (torch.randn(value.shape, generator=gen) * scale).to(value.dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "SHA256SUMS").unlink(missing_ok=True)
    return folder


def _convert(home: Path, source: Path, target_bpw: float | None, **options: Any) -> dict[str, Any]:
    rt = build_runtime(Settings(home=home))
    if target_bpw is not None:
        options["target_bpw"] = target_bpw
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), "auto", options).id
    run_job(rt, job_id)  # validate may fail on an untrained model; the files are what is checked
    with session_scope(rt.sessions) as session:
        runs = repo.latest_runs(session, job_id, with_links=True)
        outs = {
            (stage, link.name): rt.store.path(link.artifact_sha256)
            for stage, run in runs.items()
            for link in run.links
            if link.direction == "out"
        }
        assert runs["package"].status == "succeeded", runs["decompose"].error_message
        assert session.get_one(repo.Job, job_id).status in (JobState.SUCCEEDED.value, JobState.FAILED.value)
        validation = dict(runs["validate"].metrics or {}) if "validate" in runs else None
        states = {stage.value: run.status for stage, run in runs.items()}
        metrics = {stage.value: dict(run.metrics or {}) for stage, run in runs.items()}
    gguf = next(
        path
        for (stage, _name), path in outs.items()
        if stage.value == "package" and path.stat().st_size > 100_000
    )
    report = json.loads(outs[(next(s for s, _ in outs if s.value == "decompose"), "report.json")].read_text())
    imatrix = next(path for (stage, name), path in outs.items() if name == "imatrix.gguf")
    return {"gguf": gguf, "report": report, "imatrix": imatrix, "validation": validation,
            "outputs": {name for _stage, name in outs}, "states": states,
            "metrics": metrics}


def test_budget_holds_and_buys_less_error(float_checkpoint: Path, tmp_path: Path) -> None:
    small = _convert(tmp_path / "a", float_checkpoint, 3.0)
    large = _convert(tmp_path / "b", float_checkpoint, 6.0)
    costs = []
    for result in (small, large):
        allocation = result["report"]["allocation"]
        assert allocation["spent_bytes"] <= allocation["budget_bytes"] and allocation["reachable"]
        chosen = allocation["candidates"]
        assert len(chosen) == 2 * 7 + 2, "every block linear weight, the embedding and the head"
        costs.append(
            sum(next(r["cost"] for r in c["rungs"] if r["type"] == c["chosen"]) for c in chosen.values())
        )
        by_name = {t["name"]: t for t in result["report"]["tensors"]}
        for name, choice in chosen.items():
            assert by_name[name]["ggml_type"] == choice["chosen"].split("/")[0]
            assert "auto chose" in by_name[name]["reason"]
    assert costs[1] < costs[0] / 4, costs
    assert large["gguf"].stat().st_size > small["gguf"].stat().st_size
    small_types = {t["ggml_type"] for t in small["report"]["tensors"]}
    assert "Q2_0" in small_types and small_types & set(LLAMA_QUANT_TYPES), small_types


def test_quantized_tensors_are_llama_cpps_own_bytes(float_checkpoint: Path, tmp_path: Path) -> None:
    result = _convert(tmp_path / "c", float_checkpoint, 4.0)
    matrix = read_imatrix(result["imatrix"])
    source = load_file(float_checkpoint / "model.safetensors")
    checked = 0
    for tensor in GGUFFile(result["gguf"]).tensors:
        kind = tensor.tensor_type.name
        if kind not in LLAMA_QUANT_TYPES or not tensor.name.endswith(("ffn_down.weight", "ffn_up.weight")):
            continue  # the MLP weights are stored unpermuted: the source tensor is the GGUF tensor
        layer, proj = tensor.name.split(".")[1], tensor.name.split(".")[2].removeprefix("ffn_")
        weight = source[f"model.layers.{layer}.mlp.{proj}_proj.weight"].float().numpy()
        importance = matrix.importance(tensor.name)[0] if tensor.name in matrix.entries else None
        assert np.array_equal(
            np.asarray(tensor.data).reshape(-1).view(np.uint8), quantize(weight, kind, importance)
        ), tensor.name
        checked += 1
    assert checked, "the 4 bpw allocation puts some MLP weight on a llama.cpp quant"
    # llama-quantize's record of the imatrix, as llama-quantize writes it (gguf-py's own reader knows
    # no Q2_0, so ours reads this file; the calibrate end-to-end test reads a TQ2_0 file with gguf-py).
    reader = GGUFFile(result["gguf"])
    keys = (QuantizeImatrix.FILE, QuantizeImatrix.DATASET, QuantizeImatrix.ENTRIES_COUNT,
            QuantizeImatrix.CHUNKS_COUNT)
    fields = {key: reader.get_field(key) for key in keys}
    assert fields[QuantizeImatrix.FILE].contents() == "imatrix.gguf"
    assert fields[QuantizeImatrix.DATASET].contents() == matrix.datasets[0]
    assert fields[QuantizeImatrix.ENTRIES_COUNT].contents() == len(matrix.entries)
    assert fields[QuantizeImatrix.CHUNKS_COUNT].contents() == matrix.chunk_count > 0
    for key in (QuantizeImatrix.ENTRIES_COUNT, QuantizeImatrix.CHUNKS_COUNT):
        assert list(fields[key].types) == [gguf.GGUFValueType.UINT32]


def test_quality_target_keeps_the_smallest_file_that_meets_it(float_checkpoint: Path, tmp_path: Path) -> None:
    result = _convert(tmp_path / "q", float_checkpoint, None, min_top1=0.9)
    searched = result["report"]["allocation"]["search"]
    trials, chosen = searched["trials"], searched["trials"][searched["chosen"]]
    assert searched["met"] and chosen["meets"] and chosen["top1"] >= 0.9
    assert len(trials) >= 2 and searched["positions"] > 0
    # The largest budget is tried first; the choice is the smallest file that met the target.
    assert trials[0]["target_bpw"] == max(t["target_bpw"] for t in trials)
    assert chosen["file_bytes"] == min(t["file_bytes"] for t in trials if t["meets"])
    assert any(not t["meets"] for t in trials), "the all-cheapest file of a Gaussian model misses 90 %"
    assert result["report"]["allocation"]["spent_bpw"] == chosen["spent_bpw"]
    assert "candidates.png" in result["outputs"]
    # Validate confirms the target on its own text (pass or fail, the check is there with the figures).
    confirmed = result["validation"]["details"]["quality_target"]
    assert confirmed["min_top1"] == 0.9 and confirmed["search_top1"] == chosen["top1"]
    assert confirmed["verdict"] == ("pass" if confirmed["top1_agreement"] >= 0.9 else "fail")


def test_measured_sensitivity_ranks_rungs_by_the_kl_llama_cpp_measures(float_checkpoint: Path,
                                                                       tmp_path: Path) -> None:
    result = _convert(tmp_path / "m", float_checkpoint, 4.0, sensitivity="measured")
    assert result["states"]["sensitivity"] == "succeeded" and "sensitivity.json" in result["outputs"]
    stage = result["metrics"]["sensitivity"]
    assert stage["elapsed_s"] >= stage["sensitivity_s"] > 0
    assert stage["sensitivity_files"] > stage["sensitivity_steps"]
    allocation = result["report"]["allocation"]
    measured = allocation["sensitivity"]
    steps, candidates = measured["steps"], allocation["candidates"]
    # One file for the base, one per group step (and the chain's); every candidate's group went down.
    assert measured["positions"] > 0 and measured["base_kl"] >= 0
    assert measured["scored_on"] == "calibration"
    groups = {step["group"] for step in steps}
    assert "token_embd" in groups and any(g.startswith("ffn_down[") for g in groups)
    assert all(step["saved_bytes"] > 0 for step in steps)
    # The costs the allocator ranked are the measurements: the top of each hull costs nothing, and a
    # group's tensors one rung down cost (together) the KL that step added, never less than zero.
    for step in (s for s in steps if s["depth"] == 1 and s["group"] == "token_embd"):
        costs = {r["type"]: r["cost"] for r in candidates["token_embd.weight"]["rungs"]}
        assert costs[step["types"][0]] == pytest.approx(max(0.0, step["kl_rise"]), abs=1e-6)
    for name, candidate in candidates.items():
        assert min(r["cost"] for r in candidate["rungs"]) == 0.0, name
    # The allocation is a point of the measured chain: its predicted KL is that file's, as run.
    chain = measured["chain"]
    assert sorted((c["group"], c["depth"]) for c in chain) == sorted((s["group"], s["depth"]) for s in steps)
    assert measured["files"] >= 1 + len(steps) and chain[0]["kl"] is not None
    assert allocation["predicted_kl"] in [measured["base_kl"], *(c["kl"] for c in chain)]
    assert allocation["spent_bytes"] <= allocation["budget_bytes"]
    reasons = [t["reason"] for t in result["report"]["tensors"] if t["name"] in candidates]
    assert reasons and all("measured KL (nats) by rung" in reason for reason in reasons)
    # Measured once per source and ladder: another budget's job reuses the measurement, and its
    # allocation is nested in the larger budget's (no tensor goes down a rung).
    larger = _convert(tmp_path / "m", float_checkpoint, 6.0, sensitivity="measured")
    assert larger["states"]["sensitivity"] == "skipped-cached"
    assert larger["report"]["allocation"]["sensitivity"] == measured
    more = larger["report"]["allocation"]["candidates"]
    for name, candidate in candidates.items():
        order = [r["type"] for r in sorted(candidate["rungs"], key=lambda r: r["n_bytes"])]
        assert order.index(more[name]["chosen"]) >= order.index(candidate["chosen"]), name
    assert larger["report"]["allocation"]["spent_bytes"] > allocation["spent_bytes"]
