"""Error-compensating block fit (``method=gptq``): quantize columns in order, push each column's error onward.

A linear layer computes ``y = W x``. Over calibration inputs ``X`` [n, cols] with Gram matrix
``H = XᵀX``, the layer's output error of an approximation ``Ŵ`` is::

    ‖X Wᵀ − X Ŵᵀ‖²_F = Σ_r (w_r − ŵ_r) H (w_r − ŵ_r)ᵀ          (`output_sq_error`)

That is what this fit minimises, greedily, as GPTQ (Frantar et al., 2022) does: with the
upper Cholesky factor ``U`` of ``(H + λ·mean(diag H)·I)⁻¹``, columns are quantized left to
right; column ``j``'s rounding error ``e = (w_j − q_j) / U_jj`` is subtracted, times
``U[j, j+1:]``, from the columns not yet quantized: the least-squares best correction of the
remaining weights for that error (lazily, one block of columns at a time). Each row is cut into
blocks of ``block_size`` columns with one fp16 scale ``d`` and codes from ``codes`` (value =
code x d); when the sweep reaches a block, its scales are fitted to the weights as updated so
far, minimising ``Σ_j a_j (w_j − d t_j)²`` with ``a_j = 1 / U_jj²`` (the cost GPTQ's sweep
charges for column ``j``'s error; ``diag H`` when H is diagonal), exactly (`fit_block_scales`).
Last, with the codes
fixed, every row's scales are re-solved jointly for the undamped objective (a small linear
system per row: the block scales of a row interact through H) and a row keeps whichever
scales give it the lower output error.

Layouts (`LAYOUTS`): TQ2_0 / TQ1_0 blocks of 256 ternary; Q2_0 blocks of 64, ternary or the
4-level {-1, 0, 1, 2}; Q1_0 blocks of 128 binary {-1, +1}.

Example::

    fit = gptq_fit(weight, gram, LAYOUTS["TQ2_0"])
    approx = dequantize(fit.codes, fit.scales, 256)
    output_sq_error(weight, approx, gram) <= output_sq_error(weight, plain, gram)   # typically
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.fit import fit_optimal, to_fp16_scale

__all__ = [
    "CodeSet",
    "Layout",
    "TERNARY",
    "FOUR_LEVEL",
    "BINARY",
    "LAYOUTS",
    "DEFAULT_DAMP",
    "GptqFit",
    "fit_block_scales",
    "nearest_codes",
    "dequantize",
    "output_sq_error",
    "gptq_fit",
]


@dataclass(frozen=True)
class CodeSet:
    """The integer codes a block type decodes to, sorted; a weight is stored as ``code * d``."""

    name: str
    values: tuple[int, ...]


TERNARY = CodeSet("ternary", (-1, 0, 1))
FOUR_LEVEL = CodeSet("four-level", (-1, 0, 1, 2))
BINARY = CodeSet("binary", (-1, 1))


@dataclass(frozen=True)
class Layout:
    """A block type's layout for fitting: columns per scale block and the code set."""

    block_size: int
    codes: CodeSet


LAYOUTS: dict[str, Layout] = {
    GGMLTypeName.TQ2_0: Layout(256, TERNARY),
    GGMLTypeName.TQ1_0: Layout(256, TERNARY),
    GGMLTypeName.Q2_0: Layout(64, TERNARY),
    "Q2_0_4LEVEL": Layout(64, FOUR_LEVEL),
    GGMLTypeName.Q1_0: Layout(128, BINARY),
}
# GPTQ's paper damps by 1% with ~260k calibration tokens; with a few thousand tokens (the built-in
# text) H is barely full rank for wide inputs and 1% overfits: on Gemma 3 270M layers, held-out
# output error falls steadily from damp 0.01 to 0.1 and flattens by 0.3 (bench/calibration.py).
DEFAULT_DAMP = 0.1
_ENUM_ELEMENTS = 1 << 22  # float64 elements per chunk of the enumerated fit (32 MB)
_RIDGE = 1e-9  # relative ridge of the per-row scale systems: blocks whose codes are all 0


@dataclass(frozen=True)
class GptqFit:
    """Codes int8 [rows, cols], fp16-valued float32 scales [rows, cols // block_size], and the output
    error of the result (``output_sq_error`` with the undamped Gram matrix)."""

    codes: torch.Tensor
    scales: torch.Tensor
    output_sq_error: float


def nearest_codes(values: torch.Tensor, codes: CodeSet) -> torch.Tensor:
    """The nearest code to each of ``values`` (ties to the lower code), in ``values``' dtype."""
    lo, hi = codes.values[0], codes.values[-1]
    if codes.values == tuple(range(lo, hi + 1)):  # consecutive integers: round, ties down, clamp
        return torch.ceil(values - 0.5).clamp_(lo, hi)
    table = torch.tensor(codes.values, dtype=values.dtype, device=values.device)
    mids = (table[1:] + table[:-1]) / 2
    return table[torch.bucketize(values.contiguous(), mids, right=False)]


def _fit_enumerated(
    blocks: torch.Tensor, codes: CodeSet, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact weighted fit for any code set, by enumerating the code patterns a scale can induce.

    At the optimum, the codes are the nearest codes for ``d`` and ``d`` is the least-squares scale
    for those codes. As ``d`` sweeps (0, inf) the nearest codes change only where some ``w_j / d``
    crosses a midpoint ``m`` between two codes, at ``d = w_j / m``; so the pattern of the optimum
    is the pattern at some point between two consecutive such breakpoints. Each of those (at most
    ``B x (n_codes - 1) + 1`` per sign, the negative sign being an asymmetric set's mirror) is
    scored at its own least-squares ``d``: ``E = Σ a w² − (Σ a w t)² / Σ a t²``. float64 sums.
    """
    table = torch.tensor(codes.values, dtype=torch.float64, device=blocks.device)
    mids = (table[1:] + table[:-1]) / 2
    n, size = blocks.shape
    best_err = torch.full((n,), float("inf"), dtype=torch.float64, device=blocks.device)
    best_d = torch.zeros(n, dtype=torch.float64, device=blocks.device)
    a64 = a.to(torch.float64)
    chunk = max(1, _ENUM_ELEMENTS // (size * size * len(codes.values)))
    for sign in (1.0, -1.0):
        for r0 in range(0, n, chunk):
            rows = slice(r0, r0 + chunk)
            err, d = _best_pattern(sign * blocks[rows].to(torch.float64), a64[rows], codes, mids)
            better = err < best_err[rows]
            best_err[rows] = torch.where(better, err, best_err[rows])
            best_d[rows] = torch.where(better, sign * d, best_d[rows])
    d = to_fp16_scale(best_d.to(torch.float32))
    # Nearest codes for the rounded scale: never worse than the optimum's codes at that scale.
    t = nearest_codes(blocks / torch.where(d != 0, d, 1.0)[:, None], codes)
    return torch.where(d[:, None] != 0, t, torch.zeros_like(t)), d


def _candidate_scales(u: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """One scale strictly inside each interval between consecutive breakpoints ``u_j / m`` > 0 of
    each row of ``u`` [n, B], plus one below and one above them all: [n, B * len(mids) + 1]."""
    points = (u[:, :, None] / torch.where(mids != 0, mids, float("nan"))).reshape(u.shape[0], -1)
    points = torch.sort(torch.where(points > 0, points, float("inf")), dim=1).values
    finite = torch.isfinite(points)
    top = torch.where(finite, points, 0.0).amax(dim=1, keepdim=True)
    upper = torch.where(finite, points, 2 * top + 1.0)  # beyond every breakpoint
    between = (upper[:, :-1] + upper[:, 1:]) / 2
    candidates = torch.cat([points[:, :1] / 2, between, 2 * top + 1.0], dim=1)
    return torch.where(torch.isfinite(candidates) & (candidates > 0), candidates, top + 1.0)


def _best_pattern(
    u: torch.Tensor, a: torch.Tensor, codes: CodeSet, mids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(least weighted error, its least-squares scale) per row of ``u`` [n, B] over the code patterns
    of every candidate scale (float64; the pattern sums are batched products)."""
    candidates = _candidate_scales(u, mids)
    t = nearest_codes(u[:, None, :] / candidates[:, :, None], codes)  # [n, C, B]
    au = (a * u).unsqueeze(2)
    num = torch.bmm(t, au).squeeze(2)
    den = torch.bmm(t.square_(), a.unsqueeze(2)).squeeze(2)
    energy = (au.squeeze(2) * u).sum(dim=1, keepdim=True)
    positive = den > 0
    safe = den.clamp_min(1e-300)
    err = torch.where(positive, energy - num * num / safe, energy)
    pick = err.argmin(dim=1, keepdim=True)
    scale = torch.where(positive, num / safe, 0.0).gather(1, pick).squeeze(1)
    return err.gather(1, pick).squeeze(1), scale


def fit_block_scales(
    blocks: torch.Tensor, codes: CodeSet, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``blocks`` [n, B]: codes (float32 [n, B], values of ``codes``) and the fp16 scale ``d``
    [n] minimising ``Σ_j a_j (w_j − d t_j)²`` (``importance`` ``a`` broadcastable to ``blocks``; 1 when None).

    Exact (before fp16 rounding of ``d``) for every code set: ternary by `fit.fit_optimal`, binary in
    closed form (``t = sign w``, ``d = Σ a|w| / Σ a``; a zero weight takes +1), others by
    enumeration (`_fit_enumerated`).
    """
    blocks = blocks.to(torch.float32)
    a = (
        torch.ones_like(blocks)
        if importance is None
        else torch.broadcast_to(importance.to(blocks), blocks.shape)
    )
    if codes.values == TERNARY.values:
        t8, d = fit_optimal(blocks, None if importance is None else a)
        return t8.to(torch.float32), d
    if codes.values == BINARY.values:
        t = torch.where(blocks < 0, -1.0, 1.0)
        den = a.sum(dim=1)
        d = to_fp16_scale(torch.where(den > 0, (a * blocks.abs()).sum(dim=1) / den.clamp_min(1e-30), 0.0))
        return t, d
    return _fit_enumerated(blocks, codes, a)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """``codes * d`` per block: [rows, cols] float32 from codes [rows, cols] and scales [rows, cols / B]."""
    rows, cols = codes.shape
    blocks = codes.to(torch.float32).reshape(rows, cols // block_size, block_size)
    return (blocks * scales.to(torch.float32)[:, :, None]).reshape(rows, cols)


def output_sq_error(weight: torch.Tensor, approx: torch.Tensor, gram: torch.Tensor) -> float:
    """``Σ_r (w_r − ŵ_r) H (w_r − ŵ_r)ᵀ`` = ‖X Wᵀ − X Ŵᵀ‖² for ``H = XᵀX`` (float64)."""
    diff = (weight.to(torch.float64) - approx.to(torch.float64)).to(gram.device)
    return float(((diff @ gram.to(torch.float64)) * diff).sum())


def _row_errors(weight: torch.Tensor, approx: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    diff = weight.double() - approx.double()
    return ((diff @ gram) * diff).sum(dim=1)


def _refit_scales(
    weight: torch.Tensor, codes: torch.Tensor, gram: torch.Tensor, block_size: int
) -> torch.Tensor:
    """For fixed codes, each row's block scales minimising that row's output error (normal equations)."""
    rows, cols = codes.shape
    nb = cols // block_size
    t, w, h = codes.double(), weight.double(), gram
    rhs = (t * (w @ h)).reshape(rows, nb, block_size).sum(dim=2)
    system = torch.empty((rows, nb, nb), dtype=torch.float64, device=t.device)
    for b in range(nb):
        cols_b = slice(b * block_size, (b + 1) * block_size)
        system[:, b, :] = ((t[:, cols_b] @ h[cols_b, :]) * t).reshape(rows, nb, block_size).sum(dim=2)
    scale = system.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-30)
    eye = torch.eye(nb, dtype=torch.float64, device=t.device)
    d = torch.linalg.solve(system + _RIDGE * scale[:, None, None] * eye, rhs)
    return to_fp16_scale(d.to(torch.float32))


def _inverse_factor(gram: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp · mean(diag H) · I)⁻¹`` (float64 for the factorisations)."""
    h = gram.clone()
    h.diagonal().add_(damp * float(h.diagonal().mean()) + 1e-12)
    try:
        lower = torch.linalg.cholesky(h)
    except RuntimeError as exc:  # torch.linalg.LinAlgError
        raise ValueError(
            f"the damped Gram matrix is not positive definite (damp {damp}); it holds NaN/inf or "
            "came from other inputs: recollect it, or raise damp"
        ) from exc
    upper: torch.Tensor = torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    return upper


def _sweep(wt: torch.Tensor, u: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's column sweep on the transposed weight ``wt`` [cols, rows] (each column contiguous, so
    every error push is one rank-1 update); returns codes [rows, cols] and scales [rows, n_blocks]."""
    cols, rows = wt.shape
    size = layout.block_size
    codes = torch.zeros((cols, rows), dtype=torch.float32, device=wt.device)
    scales = torch.zeros((cols // size, rows), dtype=torch.float32, device=wt.device)
    for b0 in range(0, cols, size):
        b1 = b0 + size
        block, u_block = wt[b0:b1], u[b0:b1, b0:b1]  # views: updates land in wt
        errors = torch.zeros_like(block)
        _, d = fit_block_scales(block.T, layout.codes, 1.0 / u_block.diagonal().square())
        safe, live = torch.where(d != 0, d, 1.0), d != 0
        for j in range(size):
            t = torch.where(live, nearest_codes(block[j] / safe, layout.codes), 0.0)
            errors[j] = (block[j] - t * d) / u_block[j, j]
            codes[b0 + j] = t
            if j + 1 < size:
                block[j + 1 :].addr_(u_block[j, j + 1 :], errors[j], alpha=-1.0)
        scales[b0 // size] = d
        if b1 < cols:
            wt[b1:].addmm_(u[b0:b1, b1:].T, errors, alpha=-1.0)
    return codes.T.contiguous(), scales.T.contiguous()


def gptq_fit(
    weight: torch.Tensor, gram: torch.Tensor, layout: Layout, damp: float = DEFAULT_DAMP, refit: bool = True
) -> GptqFit:
    """Fit ``weight`` [rows, cols] (cols a multiple of ``layout.block_size``) to minimise the output error
    under ``gram`` [cols, cols] (``XᵀX``), as the module docstring describes. Runs on ``weight``'s device.

    ``damp``: ridge added to H, relative to its mean diagonal (see `DEFAULT_DAMP`). Raises ValueError for
    shapes that do not fit.
    """
    rows, cols = weight.shape
    size = layout.block_size
    if cols % size or gram.shape != (cols, cols):
        raise ValueError(
            f"weight {tuple(weight.shape)} and Gram {tuple(gram.shape)} do not fit blocks of {size}"
        )
    device = weight.device
    h0 = gram.to(device, torch.float64)
    h = h0.clone()
    w = weight.to(torch.float32).clone()
    dead = h.diagonal() == 0  # inputs that are always 0: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    u = _inverse_factor(h, damp).to(torch.float32)
    codes, scales = _sweep(w.T.contiguous(), u, layout)
    target = weight.to(device, torch.float32)
    errs = _row_errors(target, dequantize(codes, scales, size), h0)
    if refit:
        refitted = _refit_scales(target, codes, h0, size)
        better = _row_errors(target, dequantize(codes, refitted, size), h0) < errs
        scales = torch.where(better[:, None], refitted, scales)
    approx = dequantize(codes, scales, size)
    return GptqFit(codes.to(torch.int8), scales, output_sq_error(target, approx, h0))
