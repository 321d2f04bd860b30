"""Ternary block fits: exactness against brute force, baselines, IRLS monotonicity."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.ternary.codecs import codec_for
from pipeline.ternary.decompose import decompose_matrix
from pipeline.ternary.fit import (
    block_sq_error,
    fit_absmax,
    fit_absmean,
    fit_optimal,
    refine_irls,
    to_fp16_scale,
)


def _brute_force(block: torch.Tensor, importance: torch.Tensor | None) -> float:
    """Smallest error over every code pattern with its weighted least-squares scale (fp16)."""
    a = torch.ones_like(block) if importance is None else importance
    best = float((a * block * block).sum())
    for pattern in itertools.product((-1, 0, 1), repeat=block.numel()):
        t = torch.tensor(pattern, dtype=torch.float32)
        den = float((a * t * t).sum())
        if den == 0:
            continue
        d = to_fp16_scale(torch.tensor([(a * t * block).sum().item() / den]))
        best = min(best, float((a * (block - d * t) ** 2).sum()))
    return best


@pytest.mark.parametrize("size", [1, 3, 6])
@pytest.mark.parametrize("weighted", [False, True])
def test_optimal_matches_brute_force(size: int, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(size * 7 + weighted)
    blocks = torch.randn(12, size, generator=gen)
    blocks[0] = 0.0  # all-zero block
    if size > 1:
        blocks[1, : size // 2 + 1] = 0.5  # ties in |w|
        blocks[1, -1] = -0.5
    imp = torch.rand(12, size, generator=gen) + 0.05 if weighted else None
    codes, scales = fit_optimal(blocks, imp)
    errs = block_sq_error(blocks, codes, scales, imp)
    for i in range(blocks.shape[0]):
        expected = _brute_force(blocks[i], None if imp is None else imp[i])
        assert errs[i].item() == pytest.approx(expected, rel=2e-3, abs=1e-6)
    assert codes[0].abs().sum() == 0 and scales[0] == 0


def test_exact_ternary_weights_are_recovered() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randint(-1, 2, (64, 256), generator=gen).to(torch.int8)
    t[:, 0] = 1  # every block has a non-zero
    d = to_fp16_scale(torch.rand(64, generator=gen) * 0.1 + 0.01)
    w = t.float() * d[:, None]
    for fit in (fit_optimal, fit_absmax):
        codes, scales = fit(w)
        assert torch.equal(codes, t)
        assert torch.equal(scales, d)
        assert block_sq_error(w, codes, scales).max().item() == 0.0


def test_error_ordering_on_gaussian() -> None:
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(2))
    errs = {m: decompose_matrix(w, m).rel_error for m in ("optimal", "absmean", "absmax")}
    assert errs["optimal"] < errs["absmean"] < errs["absmax"]
    assert errs["optimal"] == pytest.approx(0.434, abs=0.01)
    assert errs["absmean"] == pytest.approx(0.512, abs=0.01)


def test_absmax_matches_gguf_reference_quantizer() -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    codes, scales = fit_absmax(w)
    ref = quants.quantize(w.numpy(), GGMLQuantizationType.TQ2_0).reshape(-1)
    assert np.array_equal(codec_for("TQ2_0").pack(codes, scales), ref)


@pytest.mark.parametrize("start", [fit_absmean, fit_absmax, fit_optimal])
def test_irls_never_worse(start) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 256, generator=gen) * torch.rand(200, 1, generator=gen)
    imp = torch.rand(256, generator=gen) ** 4
    codes, scales = start(w)
    before = block_sq_error(w, codes, scales, imp)
    codes2, scales2 = refine_irls(w, codes, scales, imp, iters=5)
    after = block_sq_error(w, codes2, scales2, imp)
    assert bool((after <= before).all())
    if start is not fit_optimal:
        assert after.sum() < before.sum()


def test_weighted_optimal_beats_irls_from_unweighted() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(100, 256, generator=gen)
    imp = torch.rand(256, generator=gen) ** 3
    exact = block_sq_error(w, *fit_optimal(w, imp), imp)
    refined = block_sq_error(w, *refine_irls(w, *fit_optimal(w), imp, iters=8), imp)
    assert bool((exact <= refined * (1 + 1e-3) + 1e-6).all())


def test_decompose_matrix_chunks_and_determinism() -> None:
    w = torch.randn(37, 512, generator=torch.Generator().manual_seed(6))
    a = decompose_matrix(w, chunk_rows=5, irls_iters=1)
    b = decompose_matrix(w, chunk_rows=64, irls_iters=1)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert a.rel_error == pytest.approx(b.rel_error, rel=1e-9)
    w_hat = (a.codes.float().reshape(37, 2, 256) * a.scales[:, :, None]).reshape(37, 512)
    direct = (torch.linalg.vector_norm(w - w_hat) / torch.linalg.vector_norm(w)).item()
    assert a.rel_error == pytest.approx(direct, rel=1e-5)
    assert 0.3 < a.sparsity < 0.6
    with pytest.raises(ValueError, match="multiple of the block size"):
        decompose_matrix(torch.zeros(2, 300))


def test_numpy_and_torch_sort_paths_agree_with_ties() -> None:
    """The numpy-sort path and the torch.sort path (used on CUDA) give the same codes and scales."""
    from pipeline.ternary.fit import _optimal_uniform

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 256, generator=gen).to(torch.bfloat16).float()  # bf16: many ties in |w|
    w[:5, :] = 0.25  # whole blocks of ties
    w[5:10, :128] = -0.5
    fit_np = _optimal_uniform(w, use_numpy=True)
    fit_t = _optimal_uniform(w, use_numpy=False)
    assert torch.equal(fit_np.codes, fit_t.codes)
    assert torch.equal(fit_np.scales, fit_t.scales)  # float64 sums: exact wherever they decide
    assert torch.equal(fit_np.n_nonzero, (fit_np.codes != 0).sum(dim=1))
    codes_w, scales_w = fit_optimal(w, torch.ones(256))  # the weighted fit with uniform weights
    assert torch.equal(codes_w, fit_np.codes) and torch.equal(scales_w, fit_np.scales)


def test_absmean_error_from_sorted_sums_matches_direct() -> None:
    from pipeline.ternary.fit import absmean_sq_error, fit_optimal_stats

    w = torch.randn(500, 256, generator=torch.Generator().manual_seed(8))
    w[0] = 0.0
    fit = fit_optimal_stats(w)
    fast = absmean_sq_error(fit, (w * w).sum(dim=1))
    direct = block_sq_error(w, *fit_absmean(w))
    assert torch.allclose(fast, direct.double(), rtol=1e-4, atol=1e-6)


def test_non_finite_weights_are_refused() -> None:
    w = torch.randn(4, 256)
    w[2, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        decompose_matrix(w)


def test_fast_path_errors_match_direct_computation() -> None:
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(64, 768, generator=gen) * torch.rand(64, 1, generator=gen)
    t = torch.randint(-1, 2, (16, 768), generator=gen).float()
    w[:16] = t * to_fp16_scale(torch.rand(16, 1, generator=gen) + 0.01)  # exactly representable rows
    fast = decompose_matrix(w)
    slow = decompose_matrix(w, importance=torch.ones(768))  # weighted path: direct error sums
    assert torch.equal(fast.codes, slow.codes) and torch.equal(fast.scales, slow.scales)
    assert fast.rel_error == pytest.approx(slow.rel_error, rel=1e-5)
    assert fast.absmean_rel_error == pytest.approx(slow.absmean_rel_error, rel=1e-4)
    assert decompose_matrix(w[:16]).rel_error == 0.0
