"""Matrix-level decomposition: a torch ``[rows, cols]`` weight into ternary codes and block scales.

Blocks run along each row (the input dimension, the last dim of a torch linear weight), which
is the order GGUF stores and llama.cpp dequantizes. Work happens in row chunks so the peak
extra memory is a few times one chunk, never a float64 copy of the matrix.

`decompose_matrix` is the TQ2_0 / TQ1_0 codecs' torch path (`codecs.tq`); `codecs.decompose_packed`
fits any low-bit type straight to its GGML bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.ternary.fit import (
    UniformFit,
    absmean_sq_error,
    block_sq_error,
    fit_absmax,
    fit_absmean,
    fit_optimal,
    fit_optimal_stats,
    refine_irls,
)
from pipeline.ternary.rows import ratio, rows_per_block

__all__ = [
    "METHODS",
    "DecomposedMatrix",
    "decompose_matrix",
    "relative_error",
    "sparsity",
]

# The torch fits by method; the TQ codecs declare the same names (a unit test holds them equal).
_FITS = {"optimal": fit_optimal, "absmean": fit_absmean, "absmax": fit_absmax}
METHODS = tuple(_FITS)


@dataclass(frozen=True)
class DecomposedMatrix:
    """Result of `decompose_matrix`; tensors live on the CPU.

    ``codes`` int8 ``[rows, cols]`` in {-1,0,1}; ``scales`` float32 ``[rows, cols // block_size]``
    (fp16-exact values); errors are Frobenius norms relative to ``||w||_F`` computed with the
    fp16 scales, i.e. the error of the packed file. ``sq_error``/``sq_norm`` are the raw sums,
    for aggregating over tensors.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    method: str
    rel_error: float
    absmean_rel_error: float
    sparsity: float
    sq_error: float
    absmean_sq_error: float
    sq_norm: float


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """``||w - w_hat||_F / ||w||_F`` (0 when both are zero, inf when only ``w`` is zero)."""
    num = torch.linalg.vector_norm((w - w_hat).to(torch.float32)).item()
    den = torch.linalg.vector_norm(w.to(torch.float32)).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def sparsity(codes: torch.Tensor) -> float:
    """Fraction of zero codes."""
    return float((codes == 0).sum().item()) / max(codes.numel(), 1)


def _fit(
    blocks: torch.Tensor, method: str, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if method == "optimal":
        return fit_optimal(blocks, importance)
    return _FITS[method](blocks)


def _fit_chunk(
    blocks: torch.Tensor, method: str, imp: torch.Tensor | None, irls_iters: int
) -> tuple[torch.Tensor, torch.Tensor, float, float, float, int]:
    """Codes, scales, and the chunk's squared error, absmean squared error, ``sum w^2``, zero count.

    Per-block sums stay float32 (256 terms); chunk totals are returned as Python floats (float64).
    The common case (optimal, uniform importance, no IRLS) takes the errors from the fit's
    sorted sums instead of extra passes over the weights.
    """
    block_norm = (blocks * blocks).sum(dim=1)
    # One check on the per-block sums instead of a pass over the weights: NaN and inf propagate.
    if not bool(torch.isfinite(block_norm).all()):
        raise ValueError("the weights hold NaN or infinite values (or |w| above 1e19)")
    norm = block_norm.double().sum().item()
    if method == "optimal" and imp is None and irls_iters == 0:
        fit = fit_optimal_stats(blocks)
        absmean_err = absmean_sq_error(fit, block_norm).sum().item()
        err = _optimal_sq_error(blocks, fit, block_norm)
        n_zero = blocks.numel() - int(fit.n_nonzero.sum().item())
        return fit.codes, fit.scales, err, absmean_err, norm, n_zero
    codes, scales = _fit(blocks, method, imp)
    base_codes, base_scales = fit_absmean(blocks)
    absmean_err = block_sq_error(blocks, base_codes, base_scales).double().sum().item()
    if irls_iters > 0:
        codes, scales = refine_irls(blocks, codes, scales, imp, iters=irls_iters)
    n_zero = int((codes == 0).sum().item())
    err = block_sq_error(blocks, codes, scales).double().sum().item()
    return codes, scales, err, absmean_err, norm, n_zero


def _optimal_sq_error(blocks: torch.Tensor, fit: UniformFit, block_norm: torch.Tensor) -> float:
    """Total squared error of an optimal fit: ``sum w^2 - 2 d S_k + d^2 k`` per block (float64).

    That identity needs no pass over the weights but carries ~1e-7 * ``sum w^2`` of float32
    noise, which matters only for blocks fitted almost exactly (ternary-trained weights):
    those are summed directly instead, so exact inputs report exactly zero.
    """
    k = fit.n_nonzero
    top_sum = torch.gather(fit.prefix, 1, (k - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    top_sum = torch.where(k > 0, top_sum, torch.zeros_like(top_sum)).double()
    d = fit.scales.double()
    norm = block_norm.double()
    err = (norm - 2 * d * top_sum + d * d * k.double()).clamp_min(0.0)
    near_exact = (err <= 1e-5 * norm).nonzero().squeeze(1)
    if near_exact.numel():
        exact = block_sq_error(blocks[near_exact], fit.codes[near_exact], fit.scales[near_exact])
        err[near_exact] = exact.double()
    return err.sum().item()


def decompose_matrix(
    w: torch.Tensor,
    method: str = "optimal",
    importance: torch.Tensor | None = None,
    irls_iters: int = 0,
    chunk_rows: int | None = None,
    device: torch.device | str | None = None,
    block_size: int = 256,
) -> DecomposedMatrix:
    """Fit every ``block_size`` run of each row of ``w`` ``[rows, cols]`` as ``d * t``.

    ``importance``: optional non-negative ``[cols]`` vector (for example mean squared input
    activations); the optimal fit and IRLS then minimise the importance-weighted error. The
    reported errors are unweighted. ``irls_iters > 0`` runs `refine_irls` after the fit.
    ``device``: where the fitting runs (default: ``w``'s device); ``w`` may stay on the CPU,
    memory-mapped, since only one chunk of ``chunk_rows`` rows is moved at a time.

    Raises ValueError for an unknown method, a non-2-D ``w``, ``cols % block_size != 0`` or
    non-finite weights.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if w.dim() != 2:
        raise ValueError(f"decompose_matrix needs a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    if cols % block_size != 0:
        raise ValueError(f"row length {cols} is not a multiple of the block size {block_size}")
    dev = torch.device(device) if device is not None else w.device
    n_per_row = cols // block_size
    step = chunk_rows or rows_per_block(cols)
    imp_row = None
    if importance is not None:
        if importance.shape != (cols,):
            raise ValueError(f"importance must have shape ({cols},), got {tuple(importance.shape)}")
        imp_row = importance.to(dev, torch.float32).reshape(1, n_per_row, block_size)
    codes_out = torch.empty((rows, cols), dtype=torch.int8)
    scales_out = torch.empty((rows, n_per_row), dtype=torch.float32)
    sq_err = sq_err_absmean = sq_norm = 0.0
    n_zero = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks = w[r0:r1].to(dev, torch.float32).reshape(-1, block_size)
        imp = None if imp_row is None else imp_row.expand(r1 - r0, -1, -1).reshape(-1, block_size)
        codes, scales, chunk_err, chunk_absmean, chunk_norm, chunk_zero = _fit_chunk(
            blocks, method, imp, irls_iters
        )
        sq_err += chunk_err
        sq_err_absmean += chunk_absmean
        sq_norm += chunk_norm
        n_zero += chunk_zero
        codes_out[r0:r1] = codes.reshape(r1 - r0, cols).cpu()
        scales_out[r0:r1] = scales.reshape(r1 - r0, n_per_row).cpu()
    return DecomposedMatrix(
        codes=codes_out,
        scales=scales_out,
        method=method,
        rel_error=ratio(sq_err, sq_norm),
        absmean_rel_error=ratio(sq_err_absmean, sq_norm),
        sparsity=n_zero / max(rows * cols, 1),
        sq_error=sq_err,
        absmean_sq_error=sq_err_absmean,
        sq_norm=sq_norm,
    )
