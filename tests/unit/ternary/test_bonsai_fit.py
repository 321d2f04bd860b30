"""The Q2_0 / Q1_0 fits are the exact optimum over levels and every finite fp16 scale: proofs by brute force.

The brute force enumerates every finite fp16 value ``d`` (both signs) and, for each, gives every
weight its nearest level, which is optimal for that ``d``; its minimum is the true optimum of
``sum a (w - d q)^2``. Ties are checked in exact rational arithmetic.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from pipeline.ternary.fit import block_sq_error, fit_optimal
from pipeline.ternary.fit_q import fit_q1_0, fit_q2_0, round_to_fp16

_ALL_FP16 = np.arange(65536, dtype=np.uint16).view(np.float16)
_FP16 = np.unique(_ALL_FP16[np.isfinite(_ALL_FP16)].astype(np.float64))  # 63,487 values, one zero
_GRIDS = {3: (-1.0, 0.0, 1.0), 4: (-1.0, 0.0, 1.0, 2.0), "q1": (-1.0, 1.0)}


def _brute(w: np.ndarray, a: np.ndarray, grid: tuple[float, ...]) -> float:
    """min over every fp16 d of sum a * min_level (w - d level)^2 (float64); the grid mirrored by d < 0."""
    levels = np.array(grid)
    best = np.inf
    for chunk in np.array_split(_FP16, 8):
        err = ((w[None, :, None] - chunk[:, None, None] * levels[None, None, :]) ** 2).min(axis=2)
        best = min(best, float((err * a[None, :]).sum(axis=1).min()))
    return best


def _error(w: torch.Tensor, a: torch.Tensor | None, codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    weights = None if a is None else a.double()
    return block_sq_error(w.double(), codes, scales.double(), weights).numpy()


def _blocks(seed: int, n: int, size: int) -> torch.Tensor:
    """Gaussian, heavy-tailed, few-level (ties) and mixed-magnitude blocks."""
    gen = torch.Generator().manual_seed(seed)
    parts = [
        torch.randn(n, size, generator=gen),
        torch.distributions.StudentT(1.5).sample((n, size)),
        torch.randint(-3, 4, (n, size), generator=gen).float() * 0.25,
        torch.randn(n, size, generator=gen) * torch.rand(n, 1, generator=gen) * 1e-3,
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("levels", [3, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_q2_0_fit_is_the_brute_force_optimum(levels: int, weighted: bool) -> None:
    size = 8
    w = _blocks(levels, 12, size)
    gen = torch.Generator().manual_seed(9)
    a = None
    if weighted:
        a = torch.rand(w.shape, generator=gen) * (torch.rand(w.shape, generator=gen) > 0.2)
    codes, scales = fit_q2_0(w, a, levels)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -1
    assert int(codes.max()) <= (1 if levels == 3 else 2)
    assert levels == 4 or bool((scales >= 0).all())
    np.testing.assert_array_equal(scales.numpy(), scales.numpy().astype(np.float16).astype(np.float32))
    ours = _error(w, a, codes, scales)
    for i in range(w.shape[0]):
        a_i = np.ones(size) if a is None else a[i].double().numpy()
        best = _brute(w[i].double().numpy(), a_i, _GRIDS[levels])
        assert ours[i] <= best * (1 + 1e-12) + 1e-300, f"block {i}: {ours[i]} > brute force {best}"


def test_q2_0_fit_full_size_blocks_against_brute_force() -> None:
    w = _blocks(5, 1, 64)
    for levels in (3, 4):
        codes, scales = fit_q2_0(w, levels=levels)
        ours = _error(w, None, codes, scales)
        for i in range(w.shape[0]):
            best = _brute(w[i].double().numpy(), np.ones(64), _GRIDS[levels])
            assert ours[i] <= best * (1 + 1e-12) + 1e-300


@pytest.mark.parametrize("weighted", [False, True])
def test_q1_0_fit_is_the_brute_force_optimum(weighted: bool) -> None:
    w = _blocks(6, 10, 16)
    a = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) if weighted else None
    codes, scales = fit_q1_0(w, a)
    assert set(codes.unique().tolist()) <= {-1, 1}
    ours = _error(w, a, codes, scales)
    for i in range(w.shape[0]):
        a_i = np.ones(16) if a is None else a[i].double().numpy()
        assert ours[i] <= _brute(w[i].double().numpy(), a_i, _GRIDS["q1"]) * (1 + 1e-12)


def _rounding_beats_continuous_block() -> torch.Tensor:
    """A block where the continuous optimum's count loses once its scale is rounded to fp16.

    Weights 1 and y with (1 + y)^2 / 2 just above 1: keeping both is the continuous optimum,
    but its scale (1 + y) / 2 is not an fp16 value while keeping only the 1 has scale 1 exactly.
    """
    for step in range(1, 400):
        y = np.float32((np.sqrt(2.0) - 1.0) * (1.0 + step * 1e-8))
        w = torch.zeros(1, 64)
        w[0, 0], w[0, 1] = 1.0, float(y)
        naive_codes, naive_scales = fit_optimal(w)
        exact = float(_brute(w[0].double().numpy(), np.ones(64), _GRIDS[3]))
        naive = float(_error(w, None, naive_codes, naive_scales)[0])
        if naive > exact * (1 + 1e-9):
            return w
    raise AssertionError("no block found where fp16 rounding changes the optimal count")


def test_fp16_rounding_of_d_is_part_of_the_optimum() -> None:
    w = _rounding_beats_continuous_block()
    naive_codes, naive_scales = fit_optimal(w)  # the TQ fitter: round the continuous optimum
    codes, scales = fit_q2_0(w)
    best = _brute(w[0].double().numpy(), np.ones(64), _GRIDS[3])
    assert int((naive_codes != 0).sum()) == 2 and int((codes != 0).sum()) == 1
    assert float(scales[0]) == 1.0
    assert _error(w, None, codes, scales)[0] == pytest.approx(best, rel=1e-15)
    assert _error(w, None, codes, scales)[0] < _error(w, None, naive_codes, naive_scales)[0]


def _exact_candidates(w: list[Fraction], levels: int) -> list[tuple[Fraction, int]]:
    """(exact error, non-zero count) of the candidates the fit scans, in its order, d rounded to fp16."""
    norm = sum(x * x for x in w)
    out = [(norm, 0)]
    order = sorted(range(len(w)), key=lambda j: (-abs(w[j]), j))
    num = den = Fraction(0)
    for j in order:
        num, den = num + abs(w[j]), den + 1
        d = Fraction(float(round_to_fp16(torch.tensor([float(num / den)], dtype=torch.float64))[0]))
        out.append((norm - (2 * d * num - d * d * den), int(den)))
    return out


def test_ties_go_to_the_earliest_candidate() -> None:
    # Every block of 4 weights from a dyadic alphabet: where two counts reach the same error
    # exactly (0.75 alone ties 0.75 with three 0.25s), the one with fewer non-zero levels wins.
    alphabet = (0.0, 0.25, -0.25, 0.5, 0.75, -1.0, 3.0)
    blocks = np.array(list(itertools.product(alphabet, repeat=4)), dtype=np.float32)
    codes, _ = fit_q2_0(torch.from_numpy(blocks))
    n_tied = 0
    for values, got in zip(blocks, (codes != 0).sum(dim=1).tolist(), strict=True):
        cands = _exact_candidates([Fraction(float(v)) for v in values], 3)
        best = min(e for e, _ in cands)
        tied = [k for e, k in cands if e == best]
        n_tied += len(tied) > 1
        assert got == tied[0], (values.tolist(), tied)
    assert n_tied > 20


def test_other_exact_ties() -> None:
    tiny = torch.full((1, 64), 2.0**-27)  # every candidate's scale rounds to fp16 zero: nothing kept
    codes, scales = fit_q2_0(tiny)
    assert not bool(codes.any()) and float(scales[0]) == 0.0
    symmetric = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, -0.5] + [0.0] * 58])  # grid and mirror tie
    codes, scales = fit_q2_0(symmetric, levels=4)
    assert float(scales[0]) > 0
    mirrored = fit_q2_0(-symmetric, levels=4)
    assert float(mirrored[1][0]) > 0  # the same rule, not the same answer flipped


def test_scale_at_an_fp16_midpoint_rounds_to_even() -> None:
    w = torch.zeros(1, 64)
    w[0, 0] = 1.0 + 2.0**-11  # halfway between fp16 1.0 and 1.0 + 2^-10
    codes, scales = fit_q2_0(w)
    assert float(scales[0]) == 1.0 and int(codes[0, 0]) == 1
    assert _error(w, None, codes, scales)[0] == _brute(w[0].double().numpy(), np.ones(64), _GRIDS[3])


def test_round_to_fp16_is_nearest_everywhere() -> None:
    gen = np.random.default_rng(7)
    x = np.concatenate([
        gen.uniform(0, 70000, 20000), np.exp(gen.uniform(np.log(1e-9), np.log(7e4), 20000)),
        (_FP16[_FP16 >= 0][:-1] + _FP16[_FP16 >= 0][1:]) / 2,  # every midpoint: ties to even
    ])
    got = round_to_fp16(torch.from_numpy(x)).numpy()
    idx = np.clip(np.searchsorted(_FP16, x), 1, _FP16.size - 1)
    lo, hi = _FP16[idx - 1], _FP16[idx]
    dist_lo, dist_hi = np.abs(x - lo), np.abs(hi - x)
    assert np.all(np.abs(got - x) <= np.minimum(dist_lo, dist_hi))
    at_mid = dist_lo == dist_hi
    even = np.where((lo.astype(np.float16).view(np.uint16) & 1) == 0, lo, hi)
    np.testing.assert_array_equal(got[at_mid], even[at_mid])
    assert float(round_to_fp16(torch.tensor([1e9], dtype=torch.float64))[0]) == 65504.0
    assert float(round_to_fp16(torch.tensor([-0.75], dtype=torch.float64))[0]) == -0.75


def test_four_levels_use_the_mirror_and_never_lose_to_three() -> None:
    w = _blocks(8, 40, 64)
    c3, s3 = fit_q2_0(w, levels=3)
    c4, s4 = fit_q2_0(w, levels=4)
    e3, e4 = _error(w, None, c3, s3), _error(w, None, c4, s4)
    assert np.all(e4 <= e3 * (1 + 1e-12)) and e4.sum() < e3.sum()
    assert bool((s4 < 0).any()) and bool((s4 > 0).any())
    skew = torch.tensor([[-3.0, -3.0, -1.5, -1.5] + [0.0] * 60])  # long negative side: mirror grid
    codes, scales = fit_q2_0(skew, levels=4)
    assert float(scales[0]) == -1.5 and codes[0, :4].tolist() == [2, 2, 1, 1]


def test_zero_importance_block_falls_back_to_uniform() -> None:
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    a = torch.ones(3, 64)
    a[1] = 0.0
    for fit in (lambda x, i: fit_q2_0(x, i), lambda x, i: fit_q2_0(x, i, 4), fit_q1_0):
        weighted = fit(w, a)
        uniform = fit(w, None)
        for got, want in zip(weighted, uniform, strict=True):
            assert torch.equal(got[1], want[1])


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="levels=5"):
        fit_q2_0(torch.zeros(1, 64), levels=5)
    with pytest.raises(ValueError, match="NaN"):
        fit_q2_0(torch.full((1, 64), float("nan")))
    with pytest.raises(ValueError, match="non-negative"):
        fit_q1_0(torch.zeros(1, 128), -torch.ones(128))
    codes, scales = fit_q2_0(torch.zeros(2, 64))
    assert not bool(codes.any()) and not bool(scales.any())


def test_the_device_independent_sum_order() -> None:
    """The column loop (the CUDA path's prefix sums) gives numpy's sequential sums bit for bit."""
    from pipeline.ternary.fit_q import _sequential_cumsum

    t = torch.distributions.StudentT(1.2).sample((64, 64)).abs().double() * 1e3
    assert torch.equal(_sequential_cumsum(t, column_loop=True), _sequential_cumsum(t, column_loop=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: checked where there is one")
def test_cuda_fits_equal_cpu_fits() -> None:
    w = _blocks(3, 64, 64)
    a = torch.rand(w.shape, generator=torch.Generator().manual_seed(0))
    for fit in (lambda x, i: fit_q2_0(x, i, 3), lambda x, i: fit_q2_0(x, i, 4), fit_q1_0):
        for importance in (None, a):
            cpu = fit(w, importance)
            gpu = fit(w.cuda(), None if importance is None else importance.cuda())
            for got, want in zip(gpu, cpu, strict=True):
                assert torch.equal(got.cpu(), want)
