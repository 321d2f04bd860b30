"""Lossless re-packing TQ2_0 / TQ1_0 <-> Q2_0: decoded weights compared bit for bit.

Decoding is llama.cpp's own (``to_float`` through `tests.support.ggml_ref`) where available,
else ours; arbitrary block bytes are used, not only ones our fitters would write.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pipeline.ternary.codecs import codec_for
from pipeline.ternary.fit import fit_optimal
from pipeline.ternary.fit_q import fit_q2_0
from pipeline.ternary.repack import NotLossless, q2_0_lossless_runs, q2_0_to_tq2_0, tq_to_q2_0
from tests.support import ggml_ref

_TYPE_IDS = {"TQ1_0": 34, "TQ2_0": 35, "Q2_0": 42}
_BYTES = {"TQ1_0": 54, "TQ2_0": 66}


def _decode(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    block_bytes, block = (18, 64) if ggml_type == "Q2_0" else (_BYTES[ggml_type], 256)
    n_values = raw.size // block_bytes * block
    if ggml_ref.available():
        return ggml_ref.dequantize(raw, _TYPE_IDS[ggml_type], n_values)
    if ggml_type == "Q2_0":
        return codec_for("Q2_0").dequantize(raw)
    return quants.dequantize(raw.reshape(-1, _BYTES[ggml_type]), GGMLQuantizationType[ggml_type]).reshape(-1)


def _random_tq(ggml_type: str, n_blocks: int, seed: int) -> np.ndarray:
    """Arbitrary code bytes (every bit pattern, TQ2_0's code 3 included) with varied fp16 scales."""
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, size=(n_blocks, _BYTES[ggml_type]), dtype=np.uint8)
    scales = np.concatenate([np.array([0.0, -0.0, 65504.0, -1.5, 2.0**-24], np.float16),
                             (gen.standard_normal(n_blocks - 5) * 0.02).astype(np.float16)])
    raw[:, -2:] = scales.astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("ggml_type", ["TQ2_0", "TQ1_0"])
def test_tq_to_q2_0_decodes_bit_for_bit(ggml_type: str) -> None:
    raw = _random_tq(ggml_type, 200, seed=1)
    q2 = tq_to_q2_0(raw, ggml_type)
    assert q2.size == 200 * 4 * 18
    np.testing.assert_array_equal(_bits(_decode(q2, "Q2_0")), _bits(_decode(raw, ggml_type)))


@pytest.mark.parametrize("ggml_type", ["TQ2_0", "TQ1_0"])
def test_fitted_tq_tensors_repack_losslessly(ggml_type: str) -> None:
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(2))
    codes, scales = fit_optimal(w.reshape(-1, 256))
    raw = codec_for(ggml_type).pack(codes, scales)
    q2 = tq_to_q2_0(raw, ggml_type)
    expected = (codes.float() * scales[:, None]).reshape(-1).numpy()
    np.testing.assert_array_equal(_bits(_decode(q2, "Q2_0")), _bits(expected))


def test_q2_0_from_tq2_0_goes_back_to_the_same_bytes() -> None:
    raw = _random_tq("TQ2_0", 120, seed=3)
    q2 = tq_to_q2_0(raw, "TQ2_0")
    assert bool(q2_0_lossless_runs(q2).all())
    back = q2_0_to_tq2_0(q2)
    np.testing.assert_array_equal(back, raw)


def test_q2_0_with_all_zero_blocks_still_converts() -> None:
    # A fitted Q2_0 row often has blocks whose every level is 0 and whose d is 0: TQ2_0's shared d
    # decodes them to the same +0.0.
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    codes, scales = fit_q2_0(w.reshape(-1, 64))
    shared = scales.reshape(4, 4)[:, :1].expand(4, 4).reshape(-1).clone()
    codes = codes.clone()
    codes[1::4] = 0  # the second block of every run: all zero, with d = 0
    shared[1::4] = 0.0
    q2 = codec_for("Q2_0").pack(codes, shared)
    back = q2_0_to_tq2_0(q2)
    np.testing.assert_array_equal(_bits(_decode(back, "TQ2_0")), _bits(_decode(q2, "Q2_0")))


def test_q2_0_with_four_scales_cannot_become_tq2_0() -> None:
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    codes, scales = fit_q2_0(w.reshape(-1, 64))
    q2 = codec_for("Q2_0").pack(codes, scales)
    ok = q2_0_lossless_runs(q2)
    assert ok.shape == (8,) and not bool(ok.any())
    with pytest.raises(NotLossless, match="8 of 8 256-weight runs.*re-fit the tensor as TQ2_0") as info:
        q2_0_to_tq2_0(q2)
    assert info.value.first_lossy == 0
    # +0.0 against -0.0
    zero_sign = codec_for("Q2_0").pack(np.zeros((4, 64), np.int8), np.array([1.0, -1.0, 1.0, 1.0]))
    assert not bool(q2_0_lossless_runs(zero_sign)[0])


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="expected TQ2_0 or TQ1_0"):
        tq_to_q2_0(np.zeros(18, np.uint8), "Q4_0")
    with pytest.raises(ValueError, match="not whole TQ1_0 blocks"):
        tq_to_q2_0(np.zeros(55, np.uint8), "TQ1_0")
    with pytest.raises(ValueError, match="not whole 256-weight runs"):
        q2_0_to_tq2_0(np.zeros(18 * 3, np.uint8))
