"""The compiled kernel against the torch reference: the same bytes, bit for bit, and exact errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.ternary import kernel
from pipeline.ternary.codecs import codec_for, decompose_packed
from pipeline.ternary.decompose import decompose_matrix
from pipeline.ternary.fit import block_sq_error, fit_absmean, fit_optimal

pytestmark = pytest.mark.skipif(not kernel.is_available(), reason="numba is not installed")

_TYPES = ("TQ2_0", "TQ1_0")


def _blocks(seed: int) -> dict[str, torch.Tensor]:
    """Blocks that exercise every path: ties, exact ternary, outliers, extreme magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    n = 600

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    def trits() -> torch.Tensor:
        return torch.randint(-3, 4, (n, 256), generator=gen).float()

    cases = {
        "gaussian_bf16": (randn(n, 256) * 0.02).to(torch.bfloat16).float(),  # many ties in |w|
        "gaussian_f32": randn(n, 256),
        "exact_ternary": trits().clamp(-1, 1) * (rand(n, 1) + 0.01),
        "few_levels": trits() * 0.125,  # tied weights straddle the optimal count
        "outliers": randn(n, 256) * torch.where(rand(n, 256) < 0.05, 30.0, 1.0),
        "two_clusters": torch.where(rand(n, 256) < 0.2, 5.0, 1.0) * (1 + 0.01 * randn(n, 256)),
        "student_t": torch.distributions.StudentT(1.5).sample((n, 256)),
        "huge": randn(8, 256) * 1e36,  # float32 sums would overflow: the float64 path
        "tiny": randn(8, 256) * 1e-38,  # subnormal weights and an fp16 scale that underflows
    }
    odd = torch.zeros(8, 256)
    odd[1, 5] = 1e-30
    odd[2, :] = 1e-9
    odd[3, 7] = -3.0
    odd[4, :3] = 70000.0  # scale clamped to fp16's 65504
    odd[5, 0], odd[5, 1] = 1e-7, 1.0
    odd[6, :] = -2.0
    odd[7, ::2] = -0.0
    cases["odd"] = odd
    return cases


def _reference(blocks: torch.Tensor, ggml_type: str) -> tuple[np.ndarray, float]:
    codes, scales = fit_optimal(blocks)
    error = float(block_sq_error(blocks.double(), codes, scales.double()).sum())
    return codec_for(ggml_type).pack(codes, scales), error


@pytest.mark.parametrize("ggml_type", _TYPES)
def test_kernel_bytes_equal_reference(ggml_type: str) -> None:
    for name, blocks in _blocks(0).items():
        raw, stats = codec_for(ggml_type).fit_pack(blocks.numpy())
        ref, ref_error = _reference(blocks, ggml_type)
        n_bad = int((raw.reshape(len(blocks), -1) != ref.reshape(len(blocks), -1)).any(axis=1).sum())
        assert n_bad == 0, f"{name}: {n_bad} of {len(blocks)} blocks differ from the reference"
        assert stats.sq_error == pytest.approx(ref_error, rel=1e-12, abs=1e-300), name
        codes, _ = fit_optimal(blocks)
        assert stats.n_nonzero == int((codes != 0).sum()), name
        assert stats.sq_norm == pytest.approx(float((blocks.double() ** 2).sum()), rel=1e-12), name


def test_kernel_absmean_error_matches_the_absmean_fit() -> None:
    blocks = _blocks(1)["gaussian_f32"]
    _, stats = codec_for("TQ2_0").fit_pack(blocks.numpy())
    direct = float(block_sq_error(blocks.double(), *(t.double() for t in fit_absmean(blocks))).sum())
    assert stats.absmean_sq_error == pytest.approx(direct, rel=1e-4)  # d: float64 vs float32 mean


def test_exact_ternary_reports_exactly_zero_error() -> None:
    gen = torch.Generator().manual_seed(2)
    d = torch.tensor([0.5, 0.015625, 3.0, 2.0**-20])[:, None]  # fp16-exact scales
    w = torch.randint(-1, 2, (4, 256), generator=gen).float() * d
    w[:, 0] = d[:, 0]
    _, stats = codec_for("TQ2_0").fit_pack(w.numpy())
    assert stats.sq_error == 0.0 and stats.sq_norm > 0


@pytest.mark.parametrize("ggml_type", _TYPES)
def test_bfloat16_read_as_stored_gives_the_same_bytes(ggml_type: str) -> None:
    w = (torch.randn(300, 256, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    w[0] = 0.0
    as_float, stats_f = codec_for(ggml_type).fit_pack(w.float().numpy())
    as_bf16, stats_b = codec_for(ggml_type).fit_pack(w.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(as_float, as_bf16) and stats_f == stats_b


def test_out_buffer_is_reused_and_refusals() -> None:
    w = torch.randn(4, 256).numpy()
    out = np.zeros(10 * 66, np.uint8)
    raw, _ = codec_for("TQ2_0").fit_pack(w, out=out)
    assert raw.base is out and raw.size == 4 * 66 and not out[4 * 66 :].any()
    with pytest.raises(ValueError, match="at least 264 bytes"):
        codec_for("TQ2_0").fit_pack(w, out=np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="not a ternary type"):
        codec_for("Q8_0").fit_pack(w)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        codec_for("TQ2_0").fit_pack(w.reshape(8, 128))
    bad = w.copy()
    bad[2, 9] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite values"):
        codec_for("TQ2_0").fit_pack(bad)


def test_decompose_packed_kernel_and_torch_paths_agree() -> None:
    w = torch.randn(64, 768, generator=torch.Generator().manual_seed(4)) * 0.02
    fast = decompose_packed(w, "TQ2_0")
    slow = decompose_packed(w, "TQ2_0", importance=torch.ones(768))  # the torch path
    assert fast.backend == "kernel" and slow.backend == "torch"
    assert np.array_equal(fast.raw, slow.raw)
    assert fast.n_zero == slow.n_zero and fast.sparsity == slow.sparsity
    assert fast.rel_error == pytest.approx(slow.rel_error, rel=1e-6)
    assert fast.absmean_rel_error == pytest.approx(decompose_matrix(w).absmean_rel_error, rel=1e-5)
    with pytest.raises(ValueError, match="multiple of the TQ2_0 block size 256"):
        decompose_packed(torch.zeros(2, 300), "TQ2_0")


def test_fp16_rounding_matches_numpy() -> None:
    from numba import njit

    from pipeline.ternary._kernel_tq_impl import _fp16_bits, _fp16_round

    @njit
    def run(xs, rounded, bits):  # type: ignore[no-untyped-def]
        tmp = np.empty(1, np.int32)
        tmpf = tmp.view(np.float32)
        for i in range(xs.size):
            rounded[i] = _fp16_round(np.float64(xs[i]), tmp, tmpf)
            bits[i] = _fp16_bits(rounded[i], tmp, tmpf)

    top = int(np.float32(65504.0).view(np.int32))
    patterns = np.concatenate(
        [
            np.arange(0, top + 1, 9973, dtype=np.int32),  # every octave, halfway cases
            np.arange(0x38800000 - 3000, 0x38800000 + 3000, dtype=np.int32),  # 2^-14
            np.arange(0x3F800000 - 3000, 0x3F800000 + 3000, dtype=np.int32),
        ]
    )
    xs = patterns.view(np.float32)
    rounded, bits = np.empty(xs.size), np.empty(xs.size, np.int64)
    run(xs, rounded, bits)
    expected = xs.astype(np.float16)
    assert np.array_equal(rounded.astype(np.float32), expected.astype(np.float32))
    assert np.array_equal(bits, expected.view(np.uint16).astype(np.int64))


@pytest.mark.parametrize("register", [True, False])
def test_compress_matches_numpy(register: bool) -> None:
    """Both compress lowerings (AVX-512 in a register, LLVM's generic compress-store), values and indices."""
    from numba import njit

    from pipeline.ternary import _kernel_ir

    if register and not _kernel_ir.REGISTER_COMPRESS:
        pytest.skip("this CPU has no AVX-512")
    saved = _kernel_ir.REGISTER_COMPRESS
    _kernel_ir.REGISTER_COMPRESS = register  # read when the intrinsic is lowered, below
    try:
        compress16 = _kernel_ir.compress16
        compress_index16 = _kernel_ir.compress_index16

        @njit
        def compact(a, lo, hi, out, idx):  # type: ignore[no-untyped-def]
            pos = 0
            n_idx = 0
            for i0 in range(0, a.shape[0], 16):
                pos = compress16(a, i0, lo, hi, out, pos)
                n_idx = compress_index16(a, i0, lo, hi, idx, n_idx)
            return pos, n_idx

        a = np.abs(np.random.default_rng(5).standard_normal(256)).astype(np.float32)
        out = np.zeros(272, np.float32)
        idx = np.zeros(272, np.int32)
        n, n_idx = compact(a, np.float32(0.5), np.float32(1.0), out, idx)
    finally:
        _kernel_ir.REGISTER_COMPRESS = saved
    expected = a[(a > 0.5) & (a <= 1.0)]
    assert n == expected.size and np.array_equal(out[:n], expected)
    assert n_idx == n and np.array_equal(idx[:n_idx], np.flatnonzero((a > 0.5) & (a <= 1.0)))
