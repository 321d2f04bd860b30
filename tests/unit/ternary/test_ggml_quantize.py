"""llama.cpp's quantizer per tensor: bytes that gguf decodes close to the input, weighted by an imatrix."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.formats.gguf.ggml_quantize import LLAMA_QUANT_TYPES, quantize
from pipeline.ternary.pack import decode_bytes, encode_plain, tensor_nbytes

pytestmark = pytest.mark.llama

# Relative error of a Gaussian matrix after a round trip: fewer bits, more error, all well below 1.
_MAX_REL = {"Q2_K": 0.45, "Q3_K": 0.25, "Q4_0": 0.15, "Q4_K": 0.12, "Q5_0": 0.08, "Q5_K": 0.06, "Q6_K": 0.03}


@pytest.mark.parametrize("type_name", LLAMA_QUANT_TYPES)
def test_round_trip_through_gguf_decoder(type_name: str) -> None:
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    raw = quantize(w, type_name)
    assert raw.size == tensor_nbytes(type_name, w.shape)
    back = decode_bytes(raw, type_name, w.shape)
    rel = float(np.linalg.norm(w - back) / np.linalg.norm(w))
    assert 0 < rel < _MAX_REL[type_name], rel


def test_importance_moves_the_error_to_unimportant_columns() -> None:
    w = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    importance = np.ones(256, np.float32)
    importance[:32] = 1000.0  # the first block's columns see large activations
    plain = decode_bytes(encode_plain(w, "Q4_K"), "Q4_K", w.shape)
    weighted = decode_bytes(encode_plain(w, "Q4_K", importance), "Q4_K", w.shape)

    def weighted_error(back: np.ndarray) -> float:
        return float((((w - back) ** 2).sum(axis=0) * importance).sum())

    assert weighted_error(weighted) < weighted_error(plain)


def test_refuses_rows_that_are_not_whole_blocks_and_unknown_types() -> None:
    with pytest.raises(ValueError, match="row length 640 is not a multiple of the Q4_K block size 256"):
        quantize(np.zeros((2, 640), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="importance has 3 entries"):
        quantize(np.zeros((2, 256), np.float32), "Q4_K", np.ones(3))
    with pytest.raises(ValueError, match="'IQ2_XXS' is not made"):
        quantize(np.zeros((2, 256), np.float32), "IQ2_XXS")
