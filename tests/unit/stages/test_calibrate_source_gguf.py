"""The 16-bit GGUF of an HF source that calibrate runs: the packager's metadata and tensor names,
the source's exact weights, computed tensors (rope factors) as the packager computes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import card_for_checkpoint, package_inputs

from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.tensor_source import dequantize_tensor
from pipeline.formats.hf.checkpoint import iter_tensors
from pipeline.formats.model_card import ModelCard
from pipeline.stages import package
from pipeline.stages.base import JobSpec
from pipeline.stages.calibrate.source_gguf import REFERENCE_KEY, write_source_gguf

_PACKAGER_ONLY = ("general.file_type", "general.name", "general.quantization_version")


def _converted(checkpoint: Path, card: dict[str, Any], tmp: Path) -> Path:
    inputs = package_inputs(checkpoint, card, tmp)
    (tmp / "work").mkdir()
    return package.run(package.make_params(JobSpec(source="demo")), inputs, tmp / "work").outputs[0].path


def _files(checkpoint: Path) -> dict[str, Path]:
    return {p.name: p for p in checkpoint.iterdir() if p.is_file()}


def test_source_gguf_holds_the_source_weights(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path: Path
) -> None:
    converted = _converted(demo_checkpoint, demo_card, tmp_path)
    card = ModelCard.from_dict(demo_card)
    ref = GGUFFile(write_source_gguf(card, _files(demo_checkpoint), tmp_path / "ref.gguf"))
    conv = GGUFFile(converted)
    assert [t.name for t in ref.tensors] == [t.name for t in conv.tensors]
    # Same architecture keys, vocabulary and tokenizer as the packaged file: only the weights differ.
    for key, field in conv.fields.items():
        if key not in _PACKAGER_ONLY and not key.startswith("bonsai."):
            assert ref.fields[key].typed() == field.typed(), key
    assert ref.fields[REFERENCE_KEY].contents() is True
    by_name = {t.name: t for t in ref.tensors}
    for name, weight in iter_tensors(card, _files(demo_checkpoint), "model.safetensors"):
        tensor = by_name[name]
        # The demo is BF16: the source GGUF keeps it exactly (1-D tensors as F32).
        assert tensor.tensor_type.name == ("F32" if weight.ndim == 1 else "BF16"), name
        np.testing.assert_array_equal(dequantize_tensor(tensor), weight.numpy())


def test_computed_tensors_equal_the_packagers(demo_checkpoint: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "llama3"
    shutil.copytree(demo_checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (checkpoint / "config.json").write_text(json.dumps(config))
    card = card_for_checkpoint(checkpoint)
    converted = _converted(checkpoint, card, tmp_path)
    ref_path = write_source_gguf(ModelCard.from_dict(card), _files(checkpoint), tmp_path / "ref.gguf")
    ref = {t.name: t for t in GGUFFile(ref_path).tensors}
    conv = {t.name: t for t in GGUFFile(converted).tensors}
    assert ref["rope_freqs.weight"].tensor_type is gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(ref["rope_freqs.weight"].data, conv["rope_freqs.weight"].data)


@pytest.mark.llama
def test_source_gguf_runs_in_llama_cpp(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path: Path
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_source_gguf(ModelCard.from_dict(demo_card), _files(demo_checkpoint), tmp_path / "ref.gguf")
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
    assert model.n_vocab() == 512
