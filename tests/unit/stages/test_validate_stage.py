"""Validate stage: the demo in llama.cpp next to its source, greedy '1+1=', checks with verdicts,
agreement figures, and a deliberately broken artifact (skeleton codes scrambled) that must fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import package_inputs

from pipeline.calibration import probe
from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.files import sha256_file
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.writer import TensorToWrite, Typed, write_gguf
from pipeline.stages import package, validate
from pipeline.stages.base import InputFile, JobSpec
from pipeline.stages.validate import file_checks
from pipeline.stages.validate.judge import agreement_stats

_SOURCE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


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


@pytest.fixture(scope="module")
def download_inputs(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, InputFile]:
    """The demo source as calibrate and decompose see it: the download files and the model card."""
    card_path = tmp_path_factory.mktemp("card") / "model_card.json"
    card_path.write_text(json.dumps(demo_card))
    items = {f"download/{n}": _input(f"download/{n}", demo_checkpoint / n) for n in _SOURCE_FILES}
    items["inspect/model_card.json"] = _input("inspect/model_card.json", card_path)
    return items


@pytest.fixture(scope="module")
def source_inputs(
    download_inputs: dict[str, InputFile], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, InputFile]:
    """The source's side as validate sees it: calibrate's reference (the source run once, stored)."""
    from pipeline.stages import calibrate

    work = tmp_path_factory.mktemp("calibrate")
    result = calibrate.run(calibrate.make_params(JobSpec(source="demo")), download_inputs, work)
    (reference,) = result.outputs
    return {"calibrate/reference.npz": _input("calibrate/reference.npz", reference.path)}


def _run(path: Path, tmp: Path, extra: dict[str, InputFile] | None = None, **options: Any) -> dict[str, Any]:
    """validate.run on `path`; the report, whether it passed or failed (ValidationFailed carries it)."""
    inputs = {"package/model.gguf": _input("package/model.gguf", path), **(extra or {})}
    params = validate.make_params(JobSpec(source="demo", options={"n_threads": 2, **options}))
    try:
        return dict(validate.run(params, inputs, tmp).metrics)
    except validate.ValidationFailed as exc:
        return {**exc.metrics, "error": str(exc)}


def _scrambled(src: Path, dest: Path, seed: int = 0) -> Path:
    """`src` with the 64 code bytes of every TQ2_0 block permuted (scales kept): same sparsity,
    same types, same size, a different matrix."""
    data = bytearray(src.read_bytes())
    perm = np.random.default_rng(seed).permutation(64)
    for tensor in GGUFFile(src).tensors:
        if tensor.tensor_type is not gguf.GGMLQuantizationType.TQ2_0:
            continue
        start, end = tensor.data_offset, tensor.data_offset + tensor.n_bytes
        blocks = np.frombuffer(bytes(data[start:end]), dtype=np.uint8).reshape(-1, 66).copy()
        blocks[:, :64] = blocks[:, perm]
        data[start:end] = blocks.tobytes()
    dest.write_bytes(bytes(data))
    return dest


def _with_chat_template(src: Path, dest: Path) -> Path:
    """`src` rewritten with a minimal chat template (the demo checkpoint has none)."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return _with_metadata(src, dest, {"tokenizer.chat_template": template})


def _with_metadata(src: Path, dest: Path, changes: dict[str, Any]) -> Path:
    """`src` rewritten with `changes` (int -> UINT32, str -> STRING) over its metadata."""
    reader = GGUFFile(src)
    meta: dict[str, Any] = {k: f.typed() for k, f in reader.fields.items() if k != "general.architecture"}
    for key, value in changes.items():
        kind = gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.STRING
        meta[key] = Typed(value, kind)
    tensors = [
        TensorToWrite(
            t.name,
            t.tensor_type,
            tuple(int(d) for d in reversed(t.shape.tolist())),
            lambda t=t: np.asarray(t.data),
        )
        for t in reader.tensors
    ]
    write_gguf(dest, "llama", meta, tensors)
    return dest


# --- pure checks --------------------------------------------------------------------------------


def test_repetition_detector() -> None:
    rep = validate.repetition_of
    assert "in a row" in rep([3, 5, 5, 5, 5, 9], "x")  # type: ignore[operator]
    assert "makes up" in rep([5, 1, 5, 2, 5, 3, 5, 4], "x")  # type: ignore[operator]
    assert "period of 3" in rep([1, 2, 3, 4, 7, 8, 9, 7, 8, 9, 7, 8], "x")  # type: ignore[operator]
    # An imperfect cycle (one odd token) is still a cycle.
    assert "period of 2" in rep([1, 2, 3, 4, 5, 6, 8, 9, 8, 9, 8, 7, 8, 9, 8, 9, 8, 9], "x")  # type: ignore[operator]
    # Judged by token ids: three different tokens that decode to "111111" are not a loop...
    assert rep([1, 2, 3], "111111") is None
    # ...nor seven different byte tokens that each render as U+FFFD.
    assert rep([239, 240, 241, 242, 243, 244, 245], "\ufffd" * 7) is None
    # The demo's output (" tre" is one token): a short pattern repeated is a loop.
    tre = [7, 7, 7, 7, 7, 30, 31, 32, 7, 7, 7, 7, 30, 31]
    assert "token 7 repeats" in rep(tre, " tre tre tre tre treumK 12val tre tre tre treumK 12")  # type: ignore[operator]
    # Without ids (an old report) the text stands in.
    assert "' tre' repeats" in rep([], " tre tre tre tre")  # type: ignore[operator]
    assert rep([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "1+1=2, 2+2=4") is None
    # Gemma 3 270M's own answer: counting is not a loop.
    counting = [
        236778,
        108,
        236778,
        236862,
        236770,
        236784,
        236800,
        108,
        236800,
        236862,
        236770,
        236784,
        236812,
        108,
        236812,
        236862,
    ]
    assert rep(counting, "2\n\n2+1=3\n\n3+1=4\n\n4+") is None
    assert rep(list(range(8)), "1   \n\n\n   2") is None  # blank runs are layout, not a loop


def test_first_answer() -> None:
    assert validate.first_answer(" 2, 2+1=3") == "2"
    assert validate.first_answer("12") == "12"
    assert validate.first_answer(" two") is None


def test_make_params_reads_options() -> None:
    params = validate.make_params(
        JobSpec(
            source="x",
            options={
                "n_ctx": "128",
                "n_gpu_layers": 99,
                "prompt": "2+2=",
                "expected": "4",
                "agreement_fail_top1": 0.2,
                "agreement_text": "Short text.",
                "method": "optimal",
            },
        )
    )
    assert (params.probe.n_ctx, params.probe.n_gpu_layers, params.probe.prompt, params.expected) == (
        128, 99, "2+2=", "4")
    assert (params.agreement_fail_top1, params.probe.agreement_text, params.probe.max_tokens) == (
        0.2, "Short text.", 16)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"n_ctx": "many"}, "n_ctx='many' is not a int"),
        ({"prompt": 12}, "must be text"),
        ({"agreement_fail_top1": 0.95}, "agreement_fail_top1"),
        ({"agreement_pass_kl": 2.0}, "agreement_pass_kl"),
        ({"n_ctx": 4}, "out of range"),
    ],
)
def test_make_params_refuses_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        validate.make_params(JobSpec(source="x", options=options))


def test_zero_sparsity_is_a_failure(tmp_path: Path) -> None:
    signs = np.where(np.arange(4 * 256) % 2 == 0, 0.5, -0.5).astype(np.float32).reshape(4, 256)
    data = gguf.quants.quantize(signs, gguf.GGMLQuantizationType.TQ2_0)
    tensor = TensorToWrite("blk.0.attn_q.weight", gguf.GGMLQuantizationType.TQ2_0, (4, 256), lambda: data)
    path = write_gguf(tmp_path / "m.gguf", "llama", {}, [tensor]).path
    check = file_checks.check_sparsity(path, None)
    assert check.verdict == "fail" and "0% sparsity" in check.reason


def test_agreement_stats() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    tokens = [1, 4, 9, 16, 25, 36]
    same = agreement_stats(logits, logits, tokens)
    assert (
        same.n_positions == 5 and same.top1_agreement == 1.0 and same.mean_kl == pytest.approx(0.0, abs=1e-12)
    )
    assert same.source_nll == same.candidate_nll
    flat = agreement_stats(logits, np.zeros_like(logits), tokens)
    # A uniform model is exactly `uniform_kl` away from the source; its NLL is log V.
    assert flat.mean_kl == pytest.approx(flat.uniform_kl) and flat.candidate_nll == pytest.approx(np.log(50))
    with pytest.raises(ValueError, match="shapes differ"):
        agreement_stats(logits, logits[:, :10], tokens)


# --- llama.cpp ----------------------------------------------------------------------------------


@pytest.mark.llama
def test_demo_validates_against_its_source(
    packaged_gguf: Path, source_inputs: dict[str, InputFile], tmp_path: Path
) -> None:
    report = _run(packaged_gguf, tmp_path, source_inputs)
    checks = report["checks"]
    assert checks["loads"] == "pass" and checks["tensor_types"] == "pass"
    assert checks["sparsity"] == "pass" and checks["bits_per_weight"] == "pass"
    # The demo's weights are exactly ternary: the conversion predicts as its source does.
    agreement = report["details"]["agreement"]
    assert checks["agreement"] == "pass", agreement["reason"]
    assert agreement["top1_agreement"] >= 0.95 and agreement["mean_kl"] < 0.01
    assert report["source"]["kind"] == "hf-16bit" and report["source"]["error"] is None
    # Random weights know no arithmetic and loop, the source as much as the conversion: warnings.
    assert checks["answer"] == "warn" and checks["source_answer"] == "warn"
    # Same weights, other kernels (BF16 vs TQ2_0 dot products): greedy texts agree at least at first.
    assert report["source"]["completion"]["text"][:8] == report["text"][:8]
    assert (
        checks["repetition"] == "warn"
        and "so the conversion is not to blame" in report["details"]["repetition"]["reason"]
    )
    assert report["verdict"] == "warn" and "chat_answer" not in checks
    assert report["chat"] == {"skipped": "the file has no tokenizer.chat_template"}
    assert 0 < report["n_tokens"] <= 16 and report["backend"]["device"] == "cpu" and report["load_s"] > 0
    written = json.loads((tmp_path / "validation.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert not list(tmp_path.glob(".*"))  # probe scratch, logits and partial report are gone
    # The source's side came from the stored reference: validate read no source file, wrote no GGUF.
    assert not list(tmp_path.rglob("*.gguf")) and agreement["reference_top_k"] == 64
    assert agreement["mean_kl_lower"] <= agreement["mean_kl"] + 4 * agreement["mean_kl_stderr"] + 1e-9


@pytest.mark.llama
def test_a_reference_for_other_prompts_is_not_used(
    packaged_gguf: Path, source_inputs: dict[str, InputFile], tmp_path: Path
) -> None:
    report = _run(packaged_gguf, tmp_path, source_inputs, prompt="2+2=", expected="4")
    assert report["checks"]["agreement"] == "warn" and "other prompts" in report["source"]["error"]
    assert report["source"]["completion"] is None and "source_answer" not in report["checks"]


@pytest.mark.llama
def test_scrambled_skeleton_fails_on_agreement(
    packaged_gguf: Path, source_inputs: dict[str, InputFile], tmp_path: Path
) -> None:
    broken = _scrambled(packaged_gguf, tmp_path / "scrambled.gguf")
    report = _run(broken, _workdir(tmp_path, "work"), source_inputs)
    checks = report["checks"]
    assert report["verdict"] == "fail" and "agreement" in report["error"]
    assert checks["agreement"] == "fail", report["details"]["agreement"]["reason"]
    agreement = report["details"]["agreement"]
    assert agreement["top1_agreement"] < 0.5 or agreement["mean_kl"] > 1.0
    # Nothing in the file's structure betrays it: only running it next to its source does.
    assert (
        checks["loads"] == checks["sparsity"] == checks["tensor_types"] == checks["bits_per_weight"] == "pass"
    )


@pytest.mark.llama
def test_without_a_source_agreement_is_not_measured(packaged_gguf: Path, tmp_path: Path) -> None:
    report = _run(packaged_gguf, tmp_path)
    assert (
        report["checks"]["agreement"] == "warn" and "not measured" in report["details"]["agreement"]["reason"]
    )
    assert report["source"]["kind"] == "none" and report["checks"]["repetition"] == "warn"


@pytest.mark.llama
def test_chat_template_is_used(packaged_gguf: Path, tmp_path: Path) -> None:
    templated = _with_chat_template(packaged_gguf, tmp_path / "chat.gguf")
    report = _run(templated, _workdir(tmp_path, "work"), chat_max_tokens=8)
    assert report["checks"]["chat_answer"] == "warn"  # random weights: no "2"
    assert report["chat"]["prompt"] == "What is 1+1?" and isinstance(report["chat"]["text"], str)
    assert report["details"]["chat_answer"]["expected"] == "2"
    # The ids llama.cpp generated, not the text tokenized again (bytes rendered as U+FFFD would merge).
    assert report["chat"]["tokens_source"] == "sampled" and 1 <= len(report["chat"]["tokens"]) <= 8


@pytest.mark.llama
def test_same_file_same_text(packaged_gguf: Path, tmp_path: Path) -> None:
    texts = [_run(packaged_gguf, _workdir(tmp_path, n), agreement_text="")["text"] for n in "ab"]
    assert texts[0] == texts[1]


@pytest.mark.llama
def test_truncated_file_fails_with_report(packaged_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "model.gguf"
    broken.write_bytes(packaged_gguf.read_bytes()[:-4096])
    workdir = _workdir(tmp_path, "work")
    with pytest.raises(IntegrityError, match="loads") as info:
        validate.run(validate.Params(), {"package/model.gguf": _input("package/model.gguf", broken)}, workdir)
    assert isinstance(info.value, validate.ValidationFailed) and info.value.metrics["checks"] == {
        "loads": "fail"
    }
    report = json.loads((workdir / "validation.json").read_text())
    assert report["verdict"] == "fail" and report["checks"] == {"loads": "fail"}


@pytest.mark.llama
def test_file_llama_cannot_load_fails(tmp_path: Path) -> None:
    # Structurally valid GGUF but no weights: llama.cpp refuses it in the child process.
    path = write_gguf(tmp_path / "empty.gguf", "llama", {}, []).path
    workdir = _workdir(tmp_path, "work")
    with pytest.raises(IntegrityError, match="could not load") as info:
        validate.run(validate.Params(), {"package/model.gguf": _input("package/model.gguf", path)}, workdir)
    assert "Traceback" not in str(info.value) and 'File "' not in str(info.value)


@pytest.mark.llama
def test_lying_hyperparameter_fails_in_llama_cpp_words(packaged_gguf: Path, tmp_path: Path) -> None:
    # The attacker's file: embedding length 512 over 256-wide tensors (a lying hidden_size).
    bad = _with_metadata(packaged_gguf, tmp_path / "bad.gguf", {"llama.embedding_length": 512})
    workdir = _workdir(tmp_path, "work")
    with pytest.raises(IntegrityError, match="could not load") as info:
        validate.run(validate.Params(), {"package/model.gguf": _input("package/model.gguf", bad)}, workdir)
    message = str(info.value)
    assert "llama.cpp said: llama_model_load: error loading model: check_tensor_dims: tensor " in message
    assert "'token_embd.weight' has wrong shape; expected 512, 512, got 256, 512" in message
    assert "Traceback" not in message and 'File "' not in message
    report = json.loads((workdir / "validation.json").read_text())
    assert report["checks"] == {"loads": "fail"}
    assert "check_tensor_dims" in json.dumps(report)


def test_probe_failure_text_drops_python_tracebacks(tmp_path: Path) -> None:
    stderr = (
        "ggml.c:123: GGML_ASSERT(n > 0) failed\n"
        "Traceback (most recent call last):\n"
        '  File "<string>", line 1, in <module>\n'
        "    main()\n"
        "ValueError: Failed to load model from file: x.gguf\n"
    )
    why = probe._failure("converted", 1, stderr, tmp_path / "absent.json")
    assert why == (
        "llama.cpp could not load or run the converted file (exit 1): ggml.c:123: GGML_ASSERT(n > 0) failed\n"
        "ValueError: Failed to load model from file: x.gguf"
    )
    error = tmp_path / "error.json"
    error.write_text(json.dumps({"error": "ValueError: boom", "llama_errors": ["a: b", "c"]}))
    assert probe._failure("source", 2, "", error) == (
        "llama.cpp could not load or run the source file; llama.cpp said: a: b; c (ValueError: boom)"
    )
    error.write_text("[1, 2")
    assert "exit 2 (llama.cpp logged no error)" in probe._failure("source", 2, "", error)


@pytest.mark.llama
def test_a_probe_child_started_before_its_file_runs_it(packaged_gguf: Path, tmp_path: Path) -> None:
    with probe.ProbeProcess(tmp_path, label="early") as child:
        late = tmp_path / "late.gguf"  # the file appears only after the child started
        shutil.copyfile(packaged_gguf, late)
        result, why = child.run(probe.ProbeRequest(path=str(late), max_tokens=2), timeout_s=120)
        with pytest.raises(RuntimeError, match="one request"):
            child.run(probe.ProbeRequest(path=str(late)), timeout_s=120)
    assert why == "" and result is not None and result.completions[0].prompt == "1+1="
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.gguf"]  # nothing of the child's left


def test_a_probe_child_never_asked_ends_quietly(tmp_path: Path) -> None:
    child = probe.ProbeProcess(tmp_path, label="unused")
    process = child._proc
    assert process is not None
    child.close()
    child.close()  # twice is harmless
    assert process.returncode is not None and not list(tmp_path.iterdir())


@pytest.mark.llama
def test_real_decompose_package_validate_chain(
    download_inputs: dict[str, InputFile], source_inputs: dict[str, InputFile], tmp_path: Path
) -> None:
    """The real producer: decompose's parts and report feed package, then validate checks against them."""
    from pipeline.stages import decompose

    job = JobSpec(source="demo", options={"device": "cpu", "n_threads": 2})
    dec = decompose.run(decompose.make_params(job), download_inputs, _workdir(tmp_path, "dec"))
    dec_inputs = {f"decompose/{o.name}": _input(f"decompose/{o.name}", o.path) for o in dec.outputs}
    pkg = package.run(package.make_params(job), {**download_inputs, **dec_inputs}, _workdir(tmp_path, "pkg"))
    val_inputs = {
        **source_inputs,
        "package/model.gguf": _input("package/model.gguf", pkg.outputs[0].path),
        "decompose/report.json": dec_inputs["decompose/report.json"],
    }
    result = validate.run(validate.make_params(job), val_inputs, _workdir(tmp_path, "val"))
    checks = result.metrics["checks"]
    assert (
        checks["loads"]
        == checks["tensor_types"]
        == checks["sparsity"]
        == checks["bits_per_weight"]
        == checks["agreement"]
        == "pass"
    )
    assert result.metrics["verdict"] == "warn" and result.warnings
    shutil.rmtree(tmp_path / "dec")
