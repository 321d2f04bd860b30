"""Per-block ternary fits: each block of weights ``w`` becomes ``d * t`` with ``t`` in {-1, 0, +1}.

All fitters take ``blocks``, a float32 tensor ``[n_blocks, block_size]`` (block_size is 256 for
llama.cpp's TQ types; smaller sizes exist for tests), on any device, and return
``(codes, scales)``: ``codes`` int8 ``[n_blocks, block_size]`` in {-1, 0, +1} and ``scales``
float32 ``[n_blocks]`` on the same device. They are deterministic: the same input gives the
same output on the same device.

GGUF stores each scale as fp16, so every fitter returns scales already rounded to fp16 (held
in float32, clamped to the fp16 range): the error a caller computes from ``(codes, scales)`` is
the error of the file, and packing is lossless. For fixed codes the squared error is a parabola
in ``d``, so the fp16 value nearest the least-squares ``d`` is the best fp16 scale for those
codes; re-fitting ``d`` after rounding cannot help. (A different code pattern could in
principle win after rounding; the effect is at the 1e-3 relative level of fp16 and ignored.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FP16_MAX",
    "fit_optimal",
    "fit_absmean",
    "fit_absmax",
    "refine_irls",
    "dequantize_blocks",
    "block_sq_error",
    "to_fp16_scale",
    "UniformFit",
    "fit_optimal_stats",
    "absmean_sq_error",
]

FP16_MAX = 65504.0


def to_fp16_scale(d: torch.Tensor) -> torch.Tensor:
    """Round scales to the nearest fp16 value (clamped to ±65504), returned as float32."""
    return d.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scales[:, None] * codes`` as float32 ``[n_blocks, block_size]``."""
    return codes.to(torch.float32) * scales.unsqueeze(1)


def block_sq_error(
    blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, importance: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-block (optionally importance-weighted) squared error ``sum_j a_j (w_j - d t_j)^2``, [n_blocks]."""
    diff = blocks - dequantize_blocks(codes, scales)
    sq = diff * diff
    if importance is not None:
        sq = sq * importance
    return sq.sum(dim=1)


def _check_blocks(blocks: torch.Tensor) -> torch.Tensor:
    if blocks.dim() != 2:
        raise ValueError(f"blocks must be 2-D [n_blocks, block_size], got shape {tuple(blocks.shape)}")
    if not blocks.is_floating_point():
        raise ValueError(f"blocks must be floating point, got {blocks.dtype}")
    return blocks.to(torch.float32)


def fit_optimal(
    blocks: torch.Tensor, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact minimiser of ``sum_j a_j (w_j - d t_j)^2`` over ``t`` in {-1,0,1}^B and scalar ``d`` per block.

    ``importance`` (``a``, non-negative, broadcastable to ``blocks``; uniform when None) weights
    each position. For a fixed ``d > 0`` the best code of each weight is ``sign(w)`` when
    ``|w| > d/2`` and 0 otherwise, whatever its weight, so the optimal non-zero set is always
    the ``k`` largest ``|w|``. For that set the best ``d`` is ``A_k / W_k`` and the error drops
    by ``A_k^2 / W_k``, where ``A_k = sum a|w|`` and ``W_k = sum a`` over the top ``k``. So: sort
    ``|w|`` descending, take cumulative sums, pick the ``k`` maximising ``A_k^2 / W_k`` (uniform:
    ``S_k^2 / k``). Ties in the objective go to the smallest ``k`` (more zeros); ties in ``|w|``
    are broken by a stable sort (lower index first). All-zero blocks give ``d = 0``, ``t = 0``.
    """
    blocks = _check_blocks(blocks)
    if importance is None:
        fit = _optimal_uniform(blocks)
        return fit.codes, fit.scales
    d, keep = _optimal_weighted(blocks, importance)
    return _codes_from_mask(blocks, d, keep)


def _codes_from_mask(
    blocks: torch.Tensor, d: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scales and ``sign(w)`` codes where ``keep``; a scale that underflows fp16 zeroes its block."""
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    scales = to_fp16_scale(d)
    keep = keep & (scales.unsqueeze(1) > 0)
    keep_i8 = keep.to(torch.int8)
    return torch.where(blocks < 0, -keep_i8, keep_i8), scales


def _sorted_prefix_sums(
    mag: torch.Tensor, use_numpy: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mag`` [n_blocks, B] (non-negative, finite) sorted ascending, and the float64 sums ``S_k`` of its
    k largest.

    The sums are exact whatever the order of addition wherever they matter: every term of an
    optimal ``S_k`` is within a factor 2^21 of the block's largest ``|w|``, so float64 holds
    the sum of 256 such float32 terms without rounding; this is what lets `kernel` (which never
    sorts) reproduce this fit bit for bit. On the CPU numpy's SIMD sort of the float bit
    patterns as int32 (the same order for non-negative floats) is ~10x faster than torch.sort.
    """
    if use_numpy if use_numpy is not None else mag.device.type == "cpu":
        import numpy as np

        ascending = np.sort(mag.contiguous().view(torch.int32).numpy(), axis=1).view(np.float32)
        prefix = np.cumsum(ascending[:, ::-1], axis=1, dtype=np.float64)
        return torch.from_numpy(ascending), torch.from_numpy(prefix)
    ascending_t = torch.sort(mag, dim=1).values
    return ascending_t, torch.cumsum(ascending_t.flip(1).double(), dim=1)


@dataclass(frozen=True)
class UniformFit:
    """`fit_optimal` (uniform importance) plus the per-block sums it already holds.

    ``ascending``: ``|w|`` sorted ascending [n_blocks, B]; ``prefix[:, k-1]``: sum of the k
    largest ``|w|`` (float64); ``n_nonzero``: non-zero codes per block (int64 [n_blocks]).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    ascending: torch.Tensor
    prefix: torch.Tensor
    n_nonzero: torch.Tensor


def _optimal_uniform(blocks: torch.Tensor, use_numpy: bool | None = None) -> UniformFit:
    """The exact uniform-importance fit (see `fit_optimal`) with its sorted magnitudes and sums."""
    block_size = blocks.shape[1]
    mag = blocks.abs()
    ascending, prefix = _sorted_prefix_sums(mag, use_numpy)
    count = torch.arange(1, block_size + 1, device=blocks.device, dtype=torch.float64)
    best = torch.argmax(prefix * prefix / count, dim=1, keepdim=True)  # first maximum: smallest k
    k = best + 1
    d = (torch.gather(prefix, 1, best).squeeze(1) / k.squeeze(1).double()).to(torch.float32)
    # The top k are the entries >= the k-th largest value v, unless entries equal to v
    # straddle position k: then only the first (lowest-index) ties are taken, which is
    # what a stable descending sort would pick. Such rows are rare; fix only them.
    v = torch.gather(ascending, 1, block_size - 1 - best)
    keep = mag >= v
    over = (keep.sum(dim=1, dtype=torch.int32, keepdim=True) != k).squeeze(1).nonzero().squeeze(1)
    if over.numel():
        m, vv = mag[over], v[over]
        tied = m == vv
        need = k[over] - (m > vv).sum(dim=1, keepdim=True)
        keep[over] = (m > vv) | (tied & (torch.cumsum(tied, dim=1) <= need))
    codes, scales = _codes_from_mask(blocks, d, keep)
    n_nonzero = torch.where(scales > 0, k.squeeze(1), torch.zeros_like(k.squeeze(1)))
    return UniformFit(codes, scales, ascending, prefix, n_nonzero)


def fit_optimal_stats(blocks: torch.Tensor) -> UniformFit:
    """`fit_optimal` with uniform importance, returning its sorted magnitudes and sums as well."""
    return _optimal_uniform(_check_blocks(blocks))


def absmean_sq_error(fit: UniformFit, sq_norm: torch.Tensor) -> torch.Tensor:
    """Per-block squared error `fit_absmean` would have, from a `UniformFit`'s sorted sums (float64).

    With ``d`` = fp16(mean|w|) the absmean codes are non-zero exactly where ``|w| > d/2``, the
    ``c`` largest entries, so the error is ``sum w^2 - 2 d S_c + d^2 c`` with no pass over the
    weights. ``sq_norm``: per-block ``sum w^2`` (its float32 rounding leaves ~1e-7 relative
    noise); ``mean|w|`` is summed in float64, so ``d`` can differ from `fit_absmean`'s (a float32
    mean) in the last bit. The report's baseline, not stored bytes.
    """
    block_size = fit.prefix.shape[1]
    d = to_fp16_scale((fit.prefix[:, -1] / block_size).to(torch.float32))
    n_above = block_size - torch.searchsorted(fit.ascending, (d / 2).unsqueeze(1), right=True)
    top_sum = torch.gather(fit.prefix, 1, (n_above - 1).clamp_min(0)).squeeze(1)
    top_sum = torch.where(n_above.squeeze(1) > 0, top_sum, torch.zeros_like(top_sum)).double()
    d64 = d.double()
    err = sq_norm.double() - 2 * d64 * top_sum + d64 * d64 * n_above.squeeze(1).double()
    return err.clamp_min(0.0)


def _optimal_weighted(blocks: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrounded optimal ``d`` (float32) and non-zero mask for per-position importance ``a``.

    Sums in float64, like the uniform fit: with ``a = 1`` both give the same codes and scales.
    """
    block_size = blocks.shape[1]
    sorted_mag, order = torch.sort(blocks.abs(), dim=1, descending=True, stable=True)
    a = torch.broadcast_to(importance.to(blocks.device, torch.float32), blocks.shape)
    a_sorted = torch.gather(a, 1, order).double()
    gain_num = torch.cumsum(a_sorted * sorted_mag.double(), dim=1)
    count = torch.cumsum(a_sorted, dim=1)
    # A prefix of zero-importance entries has no defined scale; it cannot beat k where W_k > 0.
    objective = torch.where(count > 0, gain_num * gain_num / count.clamp_min(1e-30), 0.0)
    best = torch.argmax(objective, dim=1, keepdim=True)
    d = (torch.gather(gain_num, 1, best) / torch.gather(count, 1, best)).squeeze(1).to(torch.float32)
    keep_sorted = torch.arange(block_size, device=blocks.device).unsqueeze(0) <= best
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return d, keep


def fit_absmean(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BitNet b1.58 style, per block: ``d = mean|w|`` (fp16), ``t = clamp(round(w / d), -1, 1)``.

    The baseline the report compares against. Computed as ``t = sign(w)`` where ``|w| > d/2``,
    which is that rounding with exact halves going to 0 (round half to even), and free of the
    float rounding of ``w / d``.
    """
    blocks = _check_blocks(blocks)
    d = to_fp16_scale(blocks.abs().mean(dim=1))
    keep = (blocks.abs() > (d / 2).unsqueeze(1)).to(torch.int8)
    return torch.where(blocks < 0, -keep, keep), d


def fit_absmax(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's reference TQ1_0/TQ2_0 quantizer (``quantize_row_tq2_0_ref``).

    ``d = max|w|`` (stored as fp16), ``id = 1/d`` in float32 (unrounded ``d``, as llama.cpp
    does), ``t = lroundf(w * id)``. Since ``|w * id| <= 1`` (up to one ulp), ``lroundf``
    (half away from zero) reduces to ``sign(w)`` where ``|w * id| >= 0.5`` and 0 elsewhere.
    """
    blocks = _check_blocks(blocks)
    amax = blocks.abs().amax(dim=1)
    inv = torch.where(amax > 0, 1.0 / amax, torch.zeros_like(amax))
    x = blocks * inv.unsqueeze(1)
    codes = torch.where(x.abs() >= 0.5, torch.sign(x), torch.zeros_like(x)).to(torch.int8)
    return codes, to_fp16_scale(amax)


def refine_irls(
    blocks: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    importance: torch.Tensor | None = None,
    iters: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine a fit by alternating exact code choice and weighted least squares for ``d``.

    Minimises, per block, ``E(t, d) = sum_j a_j (w_j - d t_j)^2`` with ``d`` restricted to fp16
    values, where ``a = importance`` (non-negative, broadcastable to ``blocks``, for example the
    mean squared input activation of each column; uniform when None). Each iteration:

    1. codes given ``d``: ``t_j = sign(w_j)`` if ``|w_j| > |d|/2`` else 0 (exact for every
       ``a_j > 0``; the weights do not move the threshold, they move ``d``);
    2. ``d`` given codes: ``d = sum a_j w_j t_j / sum a_j t_j^2``, rounded to fp16.

    Each step cannot raise ``E`` (up to fp16 rounding of ``d``); the per-block best of the
    start and every iterate is returned, so the result is never worse than the start under
    ``E``. Starting from ``fit_optimal(blocks, importance)`` it is a fixed point apart from
    fp16 effects; it helps most when starting from absmean/absmax or a fit made without the
    importance.
    """
    blocks = _check_blocks(blocks)
    a = None if importance is None else torch.broadcast_to(importance.to(blocks.device, torch.float32),
                                                           blocks.shape)
    best_codes, best_scales = codes.clone(), scales.clone()
    best_err = block_sq_error(blocks, best_codes, best_scales, a)
    cur_codes, cur_scales = best_codes, best_scales
    sign = torch.sign(blocks)
    for _ in range(iters):
        half = cur_scales.abs().unsqueeze(1) / 2
        t = torch.where(blocks.abs() > half, sign, torch.zeros_like(blocks))
        at = t if a is None else a * t
        num = (at * blocks).sum(dim=1)
        den = (at * t).sum(dim=1)
        d = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
        cur_scales = to_fp16_scale(d)
        cur_codes = torch.where(cur_scales.unsqueeze(1) != 0, t, torch.zeros_like(t)).to(torch.int8)
        err = block_sq_error(blocks, cur_codes, cur_scales, a)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scales = torch.where(better, cur_scales, best_scales)
        best_codes = torch.where(better.unsqueeze(1), cur_codes, best_codes)
    return best_codes, best_scales
