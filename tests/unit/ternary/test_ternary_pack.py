"""Byte-exact TQ2_0 / TQ1_0 packing, checked against gguf-py and fixed golden bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pipeline.ternary.codecs import codec_for
from pipeline.ternary.fit import fit_absmax, fit_optimal
from pipeline.ternary.pack import (
    bits_per_weight,
    decode_bytes,
    encode_plain,
    tensor_nbytes,
)

# Element i has code (i % 3) - 1 and the block scale is 0.5 (fp16 0x3800).
_GOLDEN_CODES = (np.arange(256) % 3 - 1).astype(np.int8)[None, :]
_GOLDEN = {
    # byte 0 holds elements 0, 32, 64, 96: codes+1 = 0, 2, 1, 0 -> 0 | 2<<2 | 1<<4 | 0<<6 = 0x18;
    # byte 32 holds 128, 160, 192, 224: 2, 1, 0, 2 -> 2 | 1<<2 | 0<<4 | 2<<6 = 0x86; d = 00 38.
    "TQ2_0": "18618618618618618618618618618618618618618618618618618618618618"
    "6186186186186186186186186186186186186186186186186186186186186186180038",
    # qs[0] = trits 0, 32, 64, 96, 128 -> 0,2,1,0,2 = 2*27+1*9+2 = 65 -> ceil(65*256/243) = 69 = 0x45.
    "TQ1_0": "456ccf456ccf456ccf456ccf456ccf456ccf456ccf456ccf456ccf456ccf456c"
    "94bb3194bb3194bb3194bb3194bb3194" "3092bb30" "0038",
}


def _fixture_codes(seed: int, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    codes = gen.integers(-1, 2, size=(n_blocks, 256)).astype(np.int8)
    scales = np.abs(gen.standard_normal(n_blocks)).astype(np.float16).astype(np.float32)
    return codes, scales


@pytest.mark.parametrize("ggml_type", ["TQ2_0", "TQ1_0"])
def test_golden_bytes(ggml_type: str) -> None:
    raw = codec_for(ggml_type).pack(_GOLDEN_CODES, np.array([0.5], np.float32))
    assert raw.tobytes().hex() == _GOLDEN[ggml_type]
    assert raw.size == tensor_nbytes(ggml_type, (1, 256))


@pytest.mark.parametrize("ggml_type", ["TQ2_0", "TQ1_0"])
def test_round_trip_through_gguf_dequantize(ggml_type: str) -> None:
    codes, scales = _fixture_codes(1, 40)
    raw = codec_for(ggml_type).pack(codes, scales)
    qtype = GGMLQuantizationType[ggml_type]
    assert raw.size == 40 * (66 if ggml_type == "TQ2_0" else 54)
    values = quants.dequantize(raw.reshape(4, -1), qtype).reshape(40, 256)
    np.testing.assert_array_equal(values, codes.astype(np.float32) * scales[:, None])
    codes2, scales2 = codec_for(ggml_type).unpack(raw)
    np.testing.assert_array_equal(codes2, codes)
    np.testing.assert_array_equal(scales2, scales)


@pytest.mark.parametrize("ggml_type", ["TQ2_0", "TQ1_0"])
def test_absmax_fit_matches_gguf_quantize_bytes(ggml_type: str) -> None:
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(2))
    codes, scales = fit_absmax(w.reshape(-1, 256))
    ref = quants.quantize(w.numpy(), GGMLQuantizationType[ggml_type]).reshape(-1)
    np.testing.assert_array_equal(codec_for(ggml_type).pack(codes, scales), ref)


def test_optimal_codes_survive_packing() -> None:
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    codes, scales = fit_optimal(w)
    for ggml_type in ("TQ2_0", "TQ1_0"):
        values = decode_bytes(codec_for(ggml_type).pack(codes, scales), ggml_type, (8, 256))
        np.testing.assert_array_equal(values, (codes.float() * scales[:, None]).numpy())


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="-1, 0"):
        codec_for("TQ2_0").pack(np.full((1, 256), 2, np.int8), np.ones(1, np.float32))
    with pytest.raises(ValueError, match="fp16"):
        codec_for("TQ1_0").pack(np.zeros((1, 256), np.int8), np.array([1e6], np.float32))
    with pytest.raises(ValueError, match="not a ternary type"):
        codec_for("Q4_0").pack(np.zeros((1, 256), np.int8), np.ones(1, np.float32))


@pytest.mark.parametrize("ggml_type", ["F32", "F16", "BF16", "Q8_0"])
def test_plain_types(ggml_type: str) -> None:
    w = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    raw = encode_plain(torch.from_numpy(w), ggml_type)
    assert raw.dtype == np.uint8 and raw.size == tensor_nbytes(ggml_type, (3, 64))
    back = decode_bytes(raw, ggml_type, (3, 64))
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2}[ggml_type]
    np.testing.assert_allclose(back, w, atol=tol * 3)


def test_bits_per_weight_table() -> None:
    assert bits_per_weight("TQ2_0") == 2.0625
    assert bits_per_weight("TQ1_0") == 1.6875
    assert bits_per_weight("Q8_0") == 8.5
    assert bits_per_weight("F16") == 16
    with pytest.raises(ValueError, match="F16"):
        encode_plain(np.array([1e6], np.float32), "F16")
