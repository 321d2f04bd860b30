"""The compiled Q2_0 / Q1_0 kernel against the torch fit: the same bytes, bit for bit, in every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.ternary import kernel
from pipeline.ternary.codecs import codec_for, decompose_packed
from pipeline.ternary.fit import block_sq_error, fit_absmean
from pipeline.ternary.fit_q import fit_q1_0, fit_q2_0

pytestmark = pytest.mark.skipif(not kernel.is_available(), reason="numba is not installed")

_CASES = [("Q2_0", 3), ("Q2_0", 4), ("Q1_0", 3)]


def _blocks(seed: int, size: int) -> dict[str, torch.Tensor]:
    """Blocks for every path: ties, exact levels, outliers, extreme magnitudes, fp16 edge scales."""
    gen = torch.Generator().manual_seed(seed)
    n = 400

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    cases = {
        "gaussian_bf16": (randn(n, size) * 0.02).to(torch.bfloat16).float(),  # many ties in |w|
        "gaussian_f32": randn(n, size),
        "few_levels": torch.randint(-3, 4, (n, size), generator=gen).float() * 0.125,
        "exact_ternary": torch.randint(-1, 2, (n, size), generator=gen).float() * (rand(n, 1) + 0.01),
        "outliers": randn(n, size) * torch.where(rand(n, size) < 0.05, 30.0, 1.0),
        "skewed": randn(n, size).abs() * torch.where(rand(n, 1) < 0.5, 1.0, -1.0) - 0.3,
        "student_t": torch.distributions.StudentT(1.5).sample((n, size)),
        "huge": randn(8, size) * 1e36,  # beyond the float32 chains: the sorting path
        "tiny": randn(8, size) * 1e-38,  # subnormal weights, scales that underflow fp16
        "near_fp16_min": randn(40, size) * 1e-4,  # optimum around fp16's smallest normal
        "clamped": randn(20, size) * 1e5,  # scales clamped to 65504
    }
    odd = torch.zeros(8, size)
    odd[1, 5] = 1e-30
    odd[2, :] = 1e-9
    odd[3, 7] = -3.0
    odd[4, :3] = 70000.0
    odd[5, 0], odd[5, 1] = 1e-7, 1.0
    odd[6, :] = -2.0
    odd[7, ::2] = -0.0
    cases["odd"] = odd
    return cases


def _reference(blocks: torch.Tensor, ggml_type: str, levels: int, a: torch.Tensor | None,
               ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    if ggml_type == "Q1_0":
        codes, scales = fit_q1_0(blocks, a)
        return codec_for("Q1_0").pack(codes, scales), codes, scales
    codes, scales = fit_q2_0(blocks, a, levels)
    return codec_for("Q2_0").pack(codes, scales), codes, scales


@pytest.mark.parametrize(("ggml_type", "levels"), _CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_bytes_equal_the_torch_fit(ggml_type: str, levels: int, weighted: bool) -> None:
    size = codec_for(ggml_type).block_size
    gen = torch.Generator().manual_seed(11)
    n_per_row = 4
    n_cols = n_per_row * size
    importance = torch.rand(n_cols, generator=gen) * (torch.rand(n_cols, generator=gen) > 0.1)
    importance[:size] = 0.0  # the first block of every row has no importance at all: uniform fallback
    for name, blocks in _blocks(0, size).items():
        blocks = blocks[: len(blocks) // n_per_row * n_per_row]
        a = importance.reshape(1, n_per_row, size).expand(len(blocks) // n_per_row, -1, -1).reshape(-1, size)
        raw, stats = codec_for(ggml_type).fit_pack(blocks.numpy(), levels,
                                                   importance.numpy() if weighted else None)
        ref, codes, scales = _reference(blocks, ggml_type, levels, a if weighted else None)
        n_bad = int((raw.reshape(len(blocks), -1) != ref.reshape(len(blocks), -1)).any(axis=1).sum())
        assert n_bad == 0, f"{name}: {n_bad} of {len(blocks)} blocks differ from the torch fit"
        error = float(block_sq_error(blocks.double(), codes, scales.double()).sum())
        assert stats.sq_error == pytest.approx(error, rel=1e-9, abs=1e-300), name
        assert stats.n_nonzero == int((codes != 0).sum()), name
        assert stats.sq_norm == pytest.approx(float((blocks.double() ** 2).sum()), rel=1e-12), name


@pytest.mark.parametrize(("ggml_type", "levels"), _CASES)
def test_bfloat16_as_stored_gives_the_same_bytes(ggml_type: str, levels: int) -> None:
    size = codec_for(ggml_type).block_size
    w = (torch.randn(300, size, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    raw, _ = codec_for(ggml_type).fit_pack(w.view(torch.int16).numpy().view(np.uint16), levels)
    ref, _, _ = _reference(w.float(), ggml_type, levels, None)
    np.testing.assert_array_equal(raw, ref)


def test_absmean_baseline_matches_the_absmean_fit() -> None:
    blocks = _blocks(1, 64)["gaussian_f32"]
    _, stats = codec_for("Q2_0").fit_pack(blocks.numpy())
    direct = float(block_sq_error(blocks.double(), *(t.double() for t in fit_absmean(blocks))).sum())
    assert stats.absmean_sq_error == pytest.approx(direct, rel=1e-4)  # d: float64 vs float32 mean
    assert stats.sq_error < 0.8 * stats.absmean_sq_error  # the exact fit beats absmean clearly


@pytest.mark.parametrize(("ggml_type", "levels"), _CASES)
def test_decompose_packed_uses_the_kernel_and_reports_its_errors(ggml_type: str, levels: int) -> None:
    w = torch.randn(48, 640, generator=torch.Generator().manual_seed(4))  # 640: Gemma 3's width
    imp = torch.rand(640, generator=torch.Generator().manual_seed(5))
    results = []
    for importance in (None, imp):
        packed = decompose_packed(w, ggml_type, levels=levels, importance=importance)
        results.append(packed)
        size = codec_for(ggml_type).block_size
        a = None
        if importance is not None:
            a = importance.reshape(1, -1, size).expand(48, -1, -1).reshape(-1, size)
        ref, codes, scales = _reference(w.reshape(-1, size), ggml_type, levels, a)
        assert packed.backend == "kernel"
        np.testing.assert_array_equal(packed.raw, ref)
        err = float(block_sq_error(w.reshape(-1, size).double(), codes, scales.double()).sum())
        assert packed.rel_error == pytest.approx((err / float((w.double() ** 2).sum())) ** 0.5, rel=1e-9)
    on_torch = decompose_packed(w, ggml_type, method="absmean", levels=levels)
    # absmean's d differs from the optimum's in the last fp16 bit at most for Q1_0 (float32 mean)
    assert on_torch.backend == "torch" and on_torch.rel_error >= results[0].rel_error * (1 - 1e-3)


def test_kernel_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="NaN"):
        codec_for("Q2_0").fit_pack(np.full((2, 64), np.inf, np.float32))
    with pytest.raises(ValueError, match=r"\[n_blocks, 128\]"):
        codec_for("Q1_0").fit_pack(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="levels"):
        codec_for("Q1_0").fit_pack(np.zeros((2, 128), np.float32), levels=4)
    with pytest.raises(ValueError, match="tile rows"):
        codec_for("Q2_0").fit_pack(np.zeros((3, 64), np.float32), importance=np.ones(128, np.float32))
    with pytest.raises(ValueError, match="non-negative"):
        codec_for("Q2_0").fit_pack(np.zeros((2, 64), np.float32), importance=-np.ones(64, np.float32))
    with pytest.raises(ValueError, match="irls_iters"):
        decompose_packed(torch.zeros(2, 64), "Q2_0", irls_iters=2)
    with pytest.raises(ValueError, match="multiple of the Q1_0 block size 128"):
        decompose_packed(torch.zeros(2, 192), "Q1_0")
