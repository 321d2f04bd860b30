"""Our imatrix file is llama.cpp's: its own quantizer reads it and its quantization changes with it.

IQ2_XXS is a type whose quantizer needs an importance matrix: `llama_model_quantize` refuses
the file without one, accepts it with ours (built from our collector's statistics, written and
read back through the imatrix GGUF), and gives other bytes under another importance matrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import card_for_checkpoint, package_inputs

from pipeline.calibration.imatrix import Imatrix, quantizer_imatrix, read_imatrix, write_imatrix
from pipeline.calibration.sequences import tokenize_texts
from pipeline.calibration.stats import ActivationStats
from pipeline.calibration.text import BUILTIN_NAME, builtin_text
from pipeline.demo import write_demo_checkpoint

pytestmark = pytest.mark.llama

_LLAMA_FTYPE_MOSTLY_IQ2_XXS = 19
_TEXT_CHARS = 2000


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.stages import package
    from pipeline.stages.base import JobSpec

    tmp = tmp_path_factory.mktemp("iq")
    checkpoint = write_demo_checkpoint(tmp / "ck")
    card = card_for_checkpoint(checkpoint)
    inputs = package_inputs(checkpoint, card, tmp, ternary="F32")
    (tmp / "work").mkdir()
    return package.run(package.make_params(JobSpec(source="demo")), inputs, tmp / "work").outputs[0].path


def _quantize(source: Path, dest: Path, matrix: Imatrix | None) -> int:
    from llama_cpp import llama_cpp as lib

    params = lib.llama_model_quantize_default_params()
    params.ftype = _LLAMA_FTYPE_MOSTLY_IQ2_XXS
    params.nthread = 2
    keep: Any = None
    if matrix is not None:
        keep = quantizer_imatrix(matrix)
        params.imatrix = keep.pointer
    status = int(lib.llama_model_quantize(str(source).encode(), str(dest).encode(), params))
    del keep  # the arrays had to live until the quantizer returned
    return status


def _tensor_bytes(path: Path, name: str) -> bytes:
    from pipeline.formats.gguf.reader import GGUFFile

    tensor = next(t for t in GGUFFile(path).tensors if t.name == name)
    assert tensor.tensor_type.name == "IQ2_XXS"
    return bytes(np.asarray(tensor.data).tobytes())


def test_llama_quantizer_takes_our_imatrix(f32_model: Path, tmp_path: Path) -> None:
    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.llama_session import LlamaSession, llama_errors

    seqs = tokenize_texts(f32_model, {"calibration": builtin_text()[:_TEXT_CHARS]}, n_ctx=128)
    stats = ActivationStats()
    collect_with_llama_cpp(f32_model, seqs, stats)
    written = write_imatrix(
        tmp_path / "imatrix.gguf", Imatrix.from_stats(stats, (BUILTIN_NAME,), 128, len(seqs.ids))
    )
    matrix = read_imatrix(written)
    assert len(matrix.entries) == 14 and matrix.datasets == (BUILTIN_NAME,)

    assert _quantize(f32_model, tmp_path / "none.gguf", None) != 0
    assert "requires an imatrix" in llama_errors()
    assert _quantize(f32_model, tmp_path / "ours.gguf", matrix) == 0
    with LlamaSession(tmp_path / "ours.gguf", n_ctx=32) as session:
        assert np.all(np.isfinite(session.logits(seqs.ids[0][:16])))

    # Another importance (columns reversed) changes what the quantizer writes: it used ours.
    flipped = Imatrix({n: (s[:, ::-1].copy(), c) for n, (s, c) in matrix.entries.items()}, ("x",), 1, 128)
    assert _quantize(f32_model, tmp_path / "flipped.gguf", flipped) == 0
    name = "blk.0.ffn_down.weight"
    assert _tensor_bytes(tmp_path / "ours.gguf", name) != _tensor_bytes(tmp_path / "flipped.gguf", name)
