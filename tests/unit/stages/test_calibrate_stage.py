"""Calibrate stage: the source run once (its answers and reference), the statistics recipes ask for,
and decompose reading them: importance-weighted fits, the error-compensating (gptq) fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.calibration.answers import SourceAnswers, request_key
from pipeline.calibration.gram import GramFile
from pipeline.calibration.imatrix import read_imatrix
from pipeline.calibration.reference import read_reference
from pipeline.core.errors import InputError
from pipeline.core.files import sha256_file
from pipeline.stages import calibrate, decompose, validate
from pipeline.stages.base import InputFile, JobSpec
from pipeline.stages.validate.params import DEFAULT_AGREEMENT_TEXT
from pipeline.ternary.pack import decode_bytes

_SOURCE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
# A short calibration text keeps the run small (the built-in one is ~12k demo tokens).
_TEXT = (
    "A ship sails east at dawn while gulls circle over the harbour wall. "
    "def add(a, b):\n    return a + b\n"
    "Les enfants jouent dans le jardin. 3 + 4 = 7, 12 * 12 = 144. "
) * 4
_STATS = {"importance": "imatrix", "method": "gptq", "calibration_text": _TEXT, "calibration_ctx": 64}


def _input(key: str, path: Path) -> InputFile:
    return InputFile(key.split("/", 1)[1], path, sha256_file(path), path.stat().st_size)


def _workdir(tmp: Path, name: str) -> Path:
    path = tmp / name
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def source(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, InputFile]:
    card_path = tmp_path_factory.mktemp("card") / "model_card.json"
    card_path.write_text(json.dumps(demo_card))
    items = {f"download/{n}": _input(f"download/{n}", demo_checkpoint / n) for n in _SOURCE_FILES}
    items["inspect/model_card.json"] = _input("inspect/model_card.json", card_path)
    return items


def _outputs(result: Any) -> dict[str, InputFile]:
    return {f"calibrate/{o.name}": _input(f"calibrate/{o.name}", o.path) for o in result.outputs}


@pytest.fixture(scope="module")
def with_stats(source: dict[str, InputFile], tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("calibrate-stats")
    return calibrate.run(calibrate.make_params(JobSpec("demo", options=_STATS)), source, work)


# --- parameters ---------------------------------------------------------------------------------


def test_params_follow_the_options() -> None:
    plain = calibrate.make_params(JobSpec("x"))
    assert not plain.is_statistics and plain.probe.agreement_text == DEFAULT_AGREEMENT_TEXT
    validate_prompt = validate.make_params(JobSpec("x")).probe.prompt
    assert (plain.probe.prompt, plain.probe.max_tokens) == (validate_prompt, 16)
    gptq = calibrate.make_params(JobSpec("x", options={"method": "gptq", "prompt": "2+2="}))
    assert gptq.is_gram and gptq.is_statistics and gptq.probe.prompt == "2+2=" and gptq.importance == "none"
    own = calibrate.make_params(JobSpec("x", options={"importance": "imatrix", "calibration_text": _TEXT}))
    assert own.text == _TEXT and own.dataset_name.startswith("user-calibration-")
    assert calibrate.make_params(JobSpec("x", options={"importance": "imatrix"})).dataset_name.startswith(
        "bonsai-builtin"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"importance": "fisher"}, "importance='fisher'"),
        ({"importance": "imatrix", "calibration_text": "x" + DEFAULT_AGREEMENT_TEXT}, "agreement text"),
        ({"importance": "imatrix", "calibration_text": "   \n"}, "holds no text"),
        ({"importance": "imatrix", "calibration_text": "a" * (1024 * 1024 + 1)}, "the limit is"),
        ({"importance": "imatrix", "calibration_ctx": 4}, "calibration_ctx=4"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        calibrate.make_params(JobSpec("x", options=options))


def test_decompose_reads_calibration_only_when_asked() -> None:
    inputs = {k: InputFile(k.split("/", 1)[1], Path(k), "0" * 64, 1) for k in (
        "download/model.safetensors", "inspect/model_card.json", "calibrate/reference.npz",
        "calibrate/imatrix.gguf", "calibrate/gram/blk.0.safetensors")}
    plain = decompose.select_inputs(decompose.make_params(JobSpec("x")), inputs)
    # The default recipe's cache key covers the same inputs as before calibrate existed.
    assert sorted(plain) == ["download/model.safetensors", "inspect/model_card.json"]
    weighted = decompose.select_inputs(decompose.make_params(JobSpec("x", options={"importance": "imatrix"})),
                                       inputs)
    assert "calibrate/imatrix.gguf" in weighted and "calibrate/gram/blk.0.safetensors" not in weighted
    gptq = decompose.select_inputs(decompose.make_params(JobSpec("x", options={"method": "gptq"})), inputs)
    assert "calibrate/gram/blk.0.safetensors" in gptq and "calibrate/reference.npz" not in gptq
    with pytest.raises(InputError, match="importance=imatrix weights the optimal fit"):
        decompose.make_params(JobSpec("x", options={"importance": "imatrix", "method": "absmean"}))
    # Measured sensitivity: its own stage runs the files; decompose reads its costs, not the reference.
    inputs["sensitivity/sensitivity.json"] = InputFile("sensitivity.json", Path("s"), "0" * 64, 1)
    measured = decompose.select_inputs(
        decompose.make_params(JobSpec("x", recipe="auto", options={"sensitivity": "measured"})), inputs)
    assert "calibrate/reference.npz" not in measured and "calibrate/imatrix.gguf" in measured
    assert "sensitivity/sensitivity.json" in measured
    searched = decompose.select_inputs(
        decompose.make_params(JobSpec("x", recipe="auto", options={"min_top1": 0.6})), inputs)
    assert "calibrate/reference.npz" in searched
    # Files are scored on the calibration text, which calibrate covers only when it makes an imatrix.
    for scored in ({"sensitivity": "measured"}, {"min_top1": 0.6}):
        with pytest.raises(InputError, match="drop importance=none"):
            decompose.make_params(JobSpec("x", recipe="auto", options={**scored, "importance": "none"}))


# --- llama.cpp ----------------------------------------------------------------------------------


@pytest.mark.llama
def test_default_calibration_is_the_source_reference_only(
    source: dict[str, InputFile], tmp_path: Path
) -> None:
    params = calibrate.make_params(JobSpec("demo"))
    result = calibrate.run(params, source, tmp_path)
    assert [(o.name, o.kind) for o in result.outputs] == [("reference.npz", "source-reference")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference.npz"]  # the 16-bit source is gone
    ref = read_reference(tmp_path / "reference.npz")
    answers = SourceAnswers.from_info(ref.info)
    assert answers.kind == "hf-16bit" and answers.probe.completions[0].prompt == "1+1="
    # Made for exactly the request validate will send.
    from pipeline.stages.validate.params import make_params as validate_params

    request = validate_params(JobSpec("demo")).probe.request(Path("any.gguf"), 1)
    assert answers.request == request_key(request)
    assert ref.sequences.names == ("agreement",)
    assert answers.probe.text is not None
    assert list(ref.sequences.ids[0]) == list(answers.probe.text.tokens)
    assert ref.topk_ids.shape == (len(ref.sequences.ids[0]) - 1, 64)
    assert result.metrics["source_kind"] == "hf-16bit" and result.metrics["reference_positions"] > 10


@pytest.mark.llama
def test_statistics_outputs(with_stats: Any, demo_card: dict[str, Any]) -> None:
    outputs = {o.name: o for o in with_stats.outputs}
    assert outputs["imatrix.gguf"].kind == "importance-matrix"
    assert sorted(n for n in outputs if n.startswith("gram/")) == ["gram/blk.0.safetensors",
                                                                   "gram/blk.1.safetensors"]
    matrix = read_imatrix(outputs["imatrix.gguf"].path)
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert sorted(matrix.entries) == sorted(f"blk.{i}.{k}.weight" for i in range(2) for k in kinds)
    assert matrix.datasets[0].startswith("user-calibration-") and matrix.chunk_size == 64
    importance = matrix.importance("blk.0.ffn_down.weight")
    assert importance.shape == (1, 512) and (importance > 0).all()
    gram = GramFile(outputs["gram/blk.1.safetensors"].path)
    h, count = gram.read("blk.1.ffn_down.weight")
    # XᵀX's diagonal over the same tokens is the imatrix's sum of x² (float32 rounding apart).
    sums, counts = matrix.entries["blk.1.ffn_down.weight"]
    assert count == int(counts[0]) and count > 100
    np.testing.assert_allclose(h.diagonal().numpy(), sums[0], rtol=1e-4)
    ref = read_reference(outputs["reference.npz"].path)
    assert ref.sequences.names[0] == "agreement" and set(ref.sequences.names[1:]) == {"calibration"}
    assert with_stats.metrics["calibration_sequences"] == len(ref.sequences.names) - 1


@pytest.mark.llama
@pytest.mark.parametrize("options, note", [
    ({"importance": "imatrix"}, "importance-weighted by the calibration imatrix"),
    ({"method": "gptq"}, "fitted against its input Gram matrix"),
    ({"method": "gptq", "levels": 4}, "fitted against its input Gram matrix"),
])
def test_decompose_uses_the_calibration(
    source: dict[str, InputFile], with_stats: Any, tmp_path: Path, options: dict[str, Any], note: str
) -> None:
    recipe = "q2_0" if "levels" in options else "tq2_0"
    job = JobSpec("demo", recipe, {"device": "cpu", **options})
    params = decompose.make_params(job)
    inputs = decompose.select_inputs(params, {**source, **_outputs(with_stats)})
    result = decompose.run(params, inputs, tmp_path)
    report = json.loads(next(o.path for o in result.outputs if o.name == "report.json").read_text())
    ternary = [t for t in report["tensors"] if t["is_ternary"]]
    assert len(ternary) == 14 and all(note in t["reason"] for t in ternary)
    assert all(0.0 < t["sparsity"] < 1.0 for t in ternary)
    part = next(o.path for o in result.outputs if o.name.startswith("ternary/"))
    index = decompose.read_part_index(part)
    entry = index.by_name()["blk.0.ffn_down.weight"]
    raw = np.fromfile(part, np.uint8, count=entry.n_bytes, offset=int(entry.offset or 0))
    assert np.isfinite(decode_bytes(raw, entry.ggml_type, entry.shape)).all()


# --- the block-wise torch engine ------------------------------------------------------------------


def _engine_reference(source: dict[str, InputFile], tmp: Path, engine: str, **options: Any) -> Any:
    params = calibrate.make_params(JobSpec("demo", options={"reference_engine": engine, **options}))
    work = _workdir(tmp, engine)
    return calibrate.run(params, source, work), work


@pytest.mark.llama
def test_torch_engine_makes_the_reference_llama_makes_without_the_whole_source(
    source: dict[str, InputFile], tmp_path: Path
) -> None:
    by_llama, _ = _engine_reference(source, tmp_path, "llama")
    by_torch, work = _engine_reference(source, tmp_path, "torch")
    assert sorted(p.name for p in work.iterdir()) == ["reference.npz"], "no source GGUF, no vocabulary left"
    assert by_torch.metrics["reference_engine"] == "torch"
    assert by_torch.metrics["source_kind"] == "torch-blockwise"
    assert by_llama.metrics["reference_engine"] == "llama"
    llama_ref = read_reference(by_llama.outputs[0].path)
    torch_ref = read_reference(by_torch.outputs[0].path)
    answers = SourceAnswers.from_info(torch_ref.info)
    assert answers.probe is None, "the block-wise run makes the reference only"
    assert answers.request == SourceAnswers.from_info(llama_ref.info).request, "made for validate's request"
    # The same tokens, as validate's probe of the converted file tokenizes the agreement text.
    assert torch_ref.sequences == llama_ref.sequences and torch_ref.n_vocab == llama_ref.n_vocab
    # Scored against each other: the torch forward computes llama.cpp's graph on the same weights.
    # (The demo's random weights leave near-ties, so a few top-1 picks flip on rounding alone;
    # bench/route.py --reference measures a trained-size model.)
    assert (torch_ref.topk_ids[:, 0] == llama_ref.topk_ids[:, 0]).mean() >= 0.95
    np.testing.assert_allclose(torch_ref.topk_logprobs[:, 0], llama_ref.topk_logprobs[:, 0], atol=0.02)


@pytest.mark.llama
def test_torch_engine_statistics_match_llamas(with_stats: Any, source: dict[str, InputFile],
                                              tmp_path: Path) -> None:
    by_torch, _ = _engine_reference(source, tmp_path, "torch", **_STATS)
    outputs = {o.name: o for o in by_torch.outputs}
    assert by_torch.metrics["engine"] == "torch"
    assert sorted(outputs) == sorted(o.name for o in with_stats.outputs)
    ours = read_imatrix(outputs["imatrix.gguf"].path)
    theirs = read_imatrix({o.name: o for o in with_stats.outputs}["imatrix.gguf"].path)
    assert sorted(ours.entries) == sorted(theirs.entries)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        np.testing.assert_allclose(ours.importance(name), theirs.importance(name), rtol=0.02, atol=1e-6)


def test_auto_engine_picks_by_memory(demo_card: dict[str, Any]) -> None:
    from pipeline.formats.model_card import ModelCard
    from pipeline.stages.calibrate.engines import choose_engine

    small = ModelCard.from_dict(demo_card)
    assert choose_engine(small, "auto", 10**6, 256).engine == "llama"
    big = ModelCard.from_dict({**demo_card, "param_count": 3 * 10**9})
    chosen = choose_engine(big, "auto", 10**6, 256)
    assert chosen.engine == "torch" and "instead of llama.cpp's 6.54 GB" in chosen.why
    assert choose_engine(big, "llama", 10**6, 256).engine == "llama"
    with pytest.raises(InputError, match="reference_engine=torch"):
        choose_engine(ModelCard.from_dict({**demo_card, "config": {**demo_card["config"],
                                                                   "rope_scaling": {"type": "yarn"}}}),
                      "torch", 10**6, 256)
