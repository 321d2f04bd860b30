"""Validate stage: llama.cpp loads the packaged demo, greedy '1+1=', checks with verdicts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import package_inputs

from pipeline.errors import IntegrityError
from pipeline.gguf_pack.write import TensorToWrite, write_gguf
from pipeline.stages import package, validate
from pipeline.stages.base import InputFile, JobSpec, sha256_file


def _input(key: str, path: Path) -> InputFile:
    return InputFile(key.split("/", 1)[1], path, sha256_file(path), path.stat().st_size)


def _workdir(tmp: Path, name: str) -> Path:
    path = tmp / name
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def packaged_gguf(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    tmp = tmp_path_factory.mktemp("validate")
    inputs = package_inputs(demo_checkpoint, demo_card, tmp)
    result = package.run(package.make_params(JobSpec(source="demo")), inputs, _workdir(tmp, "work"))
    return result.outputs[0].path


def test_repetition_detector() -> None:
    assert "in a row" in validate.repetition_of([3, 5, 5, 5, 5, 9], "x")  # type: ignore[operator]
    assert "makes up" in validate.repetition_of([5, 1, 5, 2, 5, 3, 5, 4], "x")  # type: ignore[operator]
    assert "period 3" in validate.repetition_of([1, 2, 3, 4, 7, 8, 9, 7, 8, 9, 7, 8], "x")  # type: ignore[operator]
    assert validate.repetition_of([1, 2, 3], "111111") is not None
    assert validate.repetition_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "1+1=2, 2+2=4") is None


def test_first_answer() -> None:
    assert validate.first_answer(" 2, 2+1=3") == "2"
    assert validate.first_answer("12") == "12"
    assert validate.first_answer(" two") is None


def test_make_params_reads_options() -> None:
    params = validate.make_params(JobSpec(source="x", options={"n_ctx": "128", "n_gpu_layers": 99}))
    assert (params.n_ctx, params.n_gpu_layers, params.prompt, params.max_tokens) == (128, 99, "1+1=", 16)


def test_zero_sparsity_is_a_failure(tmp_path: Path) -> None:
    signs = np.where(np.arange(4 * 256) % 2 == 0, 0.5, -0.5).astype(np.float32).reshape(4, 256)
    data = gguf.quants.quantize(signs, gguf.GGMLQuantizationType.TQ2_0)
    tensor = TensorToWrite("blk.0.attn_q.weight", gguf.GGMLQuantizationType.TQ2_0, (4, 256), lambda: data)
    path = write_gguf(tmp_path / "m.gguf", "llama", {}, [tensor]).path
    check = validate._check_sparsity(path, None)
    assert check.verdict == "fail" and "0% sparsity" in check.reason


@pytest.mark.llama
def test_demo_validates_with_warnings(packaged_gguf: Path, tmp_path: Path) -> None:
    params = validate.Params(n_threads=2)
    result = validate.run(
        params, {"package/model.gguf": _input("package/model.gguf", packaged_gguf)}, tmp_path
    )
    (output,) = result.outputs
    assert (output.name, output.kind, output.media_type) == (
        "validation.json",
        "validation-report",
        "application/json",
    )
    report = json.loads(output.path.read_text())
    checks = {c["name"]: c["verdict"] for c in report["checks"]}
    assert checks["loads"] == "pass"
    assert checks["sparsity"] == "pass" and checks["bits_per_weight"] == "pass"
    assert checks["tensor_types"] == "pass"
    # The demo's random weights know no arithmetic: nonsense is a warning, never a crash.
    assert checks["answer"] == "warn" and report["answer"]["is_expected"] is False
    assert report["verdict"] == "warn" and result.warnings
    probe = report["probe"]
    assert 0 < len(probe["tokens"]) <= 16 and isinstance(probe["text"], str)
    assert probe["backend"]["device"] == "cpu" and probe["load_s"] > 0
    assert result.metrics["verdict"] == report["verdict"]
    assert not list(tmp_path.glob(".*"))  # probe scratch and partial report are gone


@pytest.mark.llama
def test_same_file_same_text(packaged_gguf: Path, tmp_path: Path) -> None:
    inputs = {"package/model.gguf": _input("package/model.gguf", packaged_gguf)}
    texts = [validate.run(validate.Params(), inputs, _workdir(tmp_path, n)).metrics["text"] for n in "ab"]
    assert texts[0] == texts[1]


@pytest.mark.llama
def test_truncated_file_fails_with_report(packaged_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "model.gguf"
    broken.write_bytes(packaged_gguf.read_bytes()[:-4096])
    workdir = _workdir(tmp_path, "work")
    with pytest.raises(IntegrityError, match="loads"):
        validate.run(validate.Params(), {"package/model.gguf": _input("package/model.gguf", broken)}, workdir)
    report = json.loads((workdir / "validation.json").read_text())
    assert report["verdict"] == "fail" and report["checks"][0]["name"] == "loads"


@pytest.mark.llama
def test_file_llama_cannot_load_fails(tmp_path: Path, demo_checkpoint: Path) -> None:
    # Structurally valid GGUF but no weights: llama.cpp refuses it in the child process.
    path = write_gguf(tmp_path / "empty.gguf", "llama", {}, []).path
    workdir = _workdir(tmp_path, "work")
    with pytest.raises(IntegrityError, match="could not load"):
        validate.run(validate.Params(), {"package/model.gguf": _input("package/model.gguf", path)}, workdir)


@pytest.mark.llama
def test_real_decompose_package_validate_chain(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path: Path
) -> None:
    """The real producer: decompose's parts and report feed package, then validate checks types against it."""
    from pipeline.stages import decompose

    card_path = tmp_path / "model_card.json"
    card_path.write_text(json.dumps(demo_card))
    download = {
        f"download/{n}": _input(f"download/{n}", demo_checkpoint / n)
        for n in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
    }
    card_input = {"inspect/model_card.json": _input("inspect/model_card.json", card_path)}
    job = JobSpec(source="demo", options={"device": "cpu"})
    dec = decompose.run(decompose.make_params(job), {**download, **card_input}, _workdir(tmp_path, "dec"))
    dec_inputs = {f"decompose/{o.name}": _input(f"decompose/{o.name}", o.path) for o in dec.outputs}
    pkg = package.run(
        package.make_params(job), {**download, **card_input, **dec_inputs}, _workdir(tmp_path, "pkg")
    )
    gguf_path = pkg.outputs[0].path
    val_inputs = {
        "package/model.gguf": _input("package/model.gguf", gguf_path),
        "decompose/report.json": dec_inputs["decompose/report.json"],
    }
    result = validate.run(validate.make_params(job), val_inputs, _workdir(tmp_path, "val"))
    checks = result.metrics["checks"]
    assert (
        checks["loads"] == checks["tensor_types"] == checks["sparsity"] == checks["bits_per_weight"] == "pass"
    )
    shutil.rmtree(tmp_path / "dec")
