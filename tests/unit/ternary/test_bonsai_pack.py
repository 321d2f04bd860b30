"""Byte-exact Q2_0 / Q1_0 layouts: the type table, golden bytes, and llama.cpp's own (de)quantizers.

The reference is llama.cpp itself: ``to_float`` / ``from_float_ref`` of ggml's type traits,
called through ctypes in the libggml-base that llama-cpp-python ships (`tests.support.ggml_ref`).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pipeline.formats.gguf.types import (
    BONSAI_TYPES,
    ExtraGGMLType,
    block_geometry,
    file_type_name,
    ggml_type,
    ggml_type_from_id,
)
from pipeline.ternary.codecs import codec_for
from pipeline.ternary.fit_q import fit_q1_0_absmean, fit_q2_0, fit_q2_0_absmax
from pipeline.ternary.pack import bits_per_weight, decode_bytes, tensor_nbytes
from tests.support import ggml_ref

needs_ggml = pytest.mark.skipif(not ggml_ref.available(), reason="llama-cpp-python's libggml-base is missing")

# Q2_0: element j has level j % 4 - 1, so every byte holds codes 0, 1, 2, 3 at bits 0, 2, 4, 6:
# 0 | 1<<2 | 2<<4 | 3<<6 = 0xE4. d = 0.5 is fp16 0x3800, stored first, little-endian: 00 38.
_Q2_GOLDEN = "0038" + "e4" * 16
# Q1_0: element j is +d when j % 3 == 0. Byte 0 holds j = 0..7, set bits 0, 3, 6 -> 0x49; byte 1
# (j = 8..15) bits 1, 4, 7 -> 0x92; byte 2 bits 2, 5 -> 0x24; then the pattern repeats.
_Q1_GOLDEN = "0038" + "499224" * 5 + "49"


def test_type_table_agrees_with_gguf_and_llama_cpp() -> None:
    for name, entry in BONSAI_TYPES.items():
        assert block_geometry(name) == (entry.block_size, entry.type_size)
        if name in gguf.GGMLQuantizationType.__members__:  # gguf-py 0.19 knows Q1_0's sizes
            qtype = gguf.GGMLQuantizationType[name]
            assert int(qtype) == entry.type_id and gguf.GGML_QUANT_SIZES[qtype] == block_geometry(name)
        if ggml_ref.available():
            assert ggml_ref.type_size(entry.type_id) == (name.lower(), entry.block_size, entry.type_size)
    assert ggml_type("Q2_0") is ExtraGGMLType.Q2_0 and int(ggml_type("Q2_0")) == 42
    assert ggml_type_from_id(42).name == "Q2_0" and ggml_type_from_id(35) is gguf.GGMLQuantizationType.TQ2_0
    assert file_type_name(41) == "MOSTLY_Q2_0" and file_type_name(40) == "MOSTLY_Q1_0"
    assert bits_per_weight("Q2_0") == 2.25 and bits_per_weight("Q1_0") == 1.125
    assert tensor_nbytes("Q2_0", (3, 640)) == 3 * 10 * 18 and tensor_nbytes("Q1_0", (2, 640)) == 2 * 5 * 18
    with pytest.raises(ValueError, match="multiple of the Q1_0 block size 128"):
        tensor_nbytes("Q1_0", (2, 576))
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        ggml_type_from_id(99)


def test_golden_bytes() -> None:
    q2 = codec_for("Q2_0").pack((np.arange(64) % 4 - 1).astype(np.int8)[None], np.array([0.5], np.float32))
    assert q2.tobytes().hex() == _Q2_GOLDEN
    signs = np.where(np.arange(128) % 3 == 0, 1, -1).astype(np.int8)[None]
    q1 = codec_for("Q1_0").pack(signs, np.array([0.5], np.float32))
    assert q1.tobytes().hex() == _Q1_GOLDEN
    zeros = codec_for("Q2_0").pack(np.zeros((1, 64), np.int8), np.array([-2.0]))
    assert zeros.tobytes().hex() == "00c0" + "55" * 16  # level 0 is code 1; d = -2 is fp16 0xC000


def test_round_trip_any_levels_and_signed_scales() -> None:
    gen = np.random.default_rng(0)
    codes = gen.integers(-1, 3, size=(50, 64)).astype(np.int8)
    scales = (gen.standard_normal(50) * 3).astype(np.float16).astype(np.float32)
    back, back_scales = codec_for("Q2_0").unpack(codec_for("Q2_0").pack(codes, scales))
    np.testing.assert_array_equal(back, codes)
    np.testing.assert_array_equal(back_scales, scales)
    signs = np.where(gen.random((20, 128)) < 0.5, -1, 1).astype(np.int8)
    back1, scales1 = codec_for("Q1_0").unpack(codec_for("Q1_0").pack(signs, scales[:20]))
    np.testing.assert_array_equal(back1, signs)
    np.testing.assert_array_equal(scales1, scales[:20])
    values = decode_bytes(codec_for("Q2_0").pack(codes, scales), "Q2_0", (25, 128))
    np.testing.assert_array_equal(values, (codes * scales[:, None]).reshape(25, 128))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\{-1, 0, 1, 2\}"):
        codec_for("Q2_0").pack(np.full((1, 64), 3, np.int8), np.ones(1))
    with pytest.raises(ValueError, match="-1 or \\+1"):
        codec_for("Q1_0").pack(np.zeros((1, 128), np.int8), np.ones(1))
    with pytest.raises(ValueError, match="fp16"):
        codec_for("Q2_0").pack(np.zeros((1, 64), np.int8), np.array([1e6]))
    with pytest.raises(ValueError, match="2 blocks of codes but 1 scales"):
        codec_for("Q1_0").pack(np.ones((2, 128), np.int8), np.ones(1))
    with pytest.raises(ValueError, match="not whole Q2_0 blocks"):
        codec_for("Q2_0").unpack(np.zeros(19, np.uint8))


@needs_ggml
@pytest.mark.parametrize("ggml_name", ["Q2_0", "Q1_0"])
def test_our_decode_is_llama_cpp_dequantize(ggml_name: str) -> None:
    """Every code and a spread of scales (signed, subnormal, 65504), decoded by llama.cpp and by us."""
    gen = np.random.default_rng(1)
    type_id = BONSAI_TYPES[ggml_name].type_id
    n_blocks = 300
    raw = gen.integers(0, 256, size=(n_blocks, 18), dtype=np.uint8)
    specials = np.array([0.0, -0.0, 65504.0, -65504.0, 2.0**-24, 6.1e-5, 1.0, -3.5], np.float16)
    spread = (gen.standard_normal(n_blocks - specials.size) * 0.05).astype(np.float16)
    scales = np.concatenate([specials, spread])
    raw[:, :2] = scales.astype("<f2").view(np.uint8).reshape(-1, 2)
    block = BONSAI_TYPES[ggml_name].block_size
    theirs = ggml_ref.dequantize(raw.reshape(-1), type_id, n_blocks * block)
    ours = codec_for(ggml_name).dequantize(raw)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@needs_ggml
def test_llama_cpp_reference_rules_give_llama_cpp_bytes() -> None:
    """Our packing of llama.cpp's rules (Q2_0 d = max|w|, Q1_0 d = mean|w|) is its quantizer's bytes."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(400, 256, generator=gen) * 0.02
    w[0, :64] = 0.0  # all-zero block: d = 0
    w[1, :64] = torch.linspace(-1, 1, 64)  # exact halves of d: roundf's ties away from zero
    w[2, :128] = -0.0  # negative zero: llama.cpp's x >= 0 gives bit 1
    w[3] = (torch.randn(256, generator=gen) * 1e-6).to(torch.bfloat16).float()  # subnormal fp16 scales
    for type_id, ours in (
        (42, codec_for("Q2_0").pack(*fit_q2_0_absmax(w.reshape(-1, 64)))),
        (41, codec_for("Q1_0").pack(*fit_q1_0_absmean(w.reshape(-1, 128)))),
    ):
        np.testing.assert_array_equal(ours, ggml_ref.quantize_ref(w.numpy(), type_id))


@needs_ggml
def test_optimal_fit_decodes_in_llama_cpp_as_fitted() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    for levels in (3, 4):
        codes, scales = fit_q2_0(w.reshape(-1, 64), levels=levels)
        theirs = ggml_ref.dequantize(codec_for("Q2_0").pack(codes, scales), 42, w.numel())
        np.testing.assert_array_equal(theirs, (codes.float() * scales[:, None]).reshape(-1).numpy())
        assert levels == 3 or int((codes == 2).sum()) > 0  # level +2 really used (code 3)
