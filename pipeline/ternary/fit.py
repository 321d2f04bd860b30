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
        d, keep = _optimal_uniform(blocks)
    else:
        d, keep = _optimal_weighted(blocks, importance)
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    scales = to_fp16_scale(d)
    keep &= scales.unsqueeze(1) > 0  # a scale that underflows fp16 zeroes its block
    codes = torch.sign(blocks).to(torch.int8) * keep.to(torch.int8)
    return codes, scales


def _sorted_prefix_sums(
    mag: torch.Tensor, use_numpy: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mag`` [n_blocks, B] (non-negative, finite) sorted ascending, and the sums ``S_k`` of its k largest.

    On the CPU numpy's SIMD sort of the float bit patterns as int32 (the same order for
    non-negative floats) is ~10x faster than torch.sort, which also builds indices this path
    does not need; the running sum is taken over the reversed view, without a flipped copy.
    """
    if use_numpy if use_numpy is not None else mag.device.type == "cpu":
        import numpy as np

        ascending = np.sort(mag.contiguous().view(torch.int32).numpy(), axis=1).view(np.float32)
        prefix = np.empty(ascending.shape, dtype=np.float32)
        np.add.accumulate(ascending[:, ::-1], axis=1, out=prefix)
        return torch.from_numpy(ascending), torch.from_numpy(prefix)
    ascending_t = torch.sort(mag, dim=1).values
    return ascending_t, torch.cumsum(ascending_t.flip(1), dim=1)


def _optimal_uniform(
    blocks: torch.Tensor, use_numpy: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrounded optimal ``d`` [n_blocks] and the non-zero mask [n_blocks, B] for uniform importance."""
    block_size = blocks.shape[1]
    mag = blocks.abs()
    ascending, prefix = _sorted_prefix_sums(mag, use_numpy)
    count = torch.arange(1, block_size + 1, device=blocks.device, dtype=torch.float32)
    best = torch.argmax(prefix * prefix / count, dim=1, keepdim=True)  # first maximum: smallest k
    k = best + 1
    d = torch.gather(prefix, 1, best).squeeze(1) / k.squeeze(1).to(torch.float32)
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
    return d, keep


def _optimal_weighted(blocks: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrounded optimal ``d`` and non-zero mask for per-position importance ``a``."""
    block_size = blocks.shape[1]
    sorted_mag, order = torch.sort(blocks.abs(), dim=1, descending=True, stable=True)
    a = torch.broadcast_to(importance.to(blocks.device, torch.float32), blocks.shape)
    a_sorted = torch.gather(a, 1, order)
    gain_num = torch.cumsum(a_sorted * sorted_mag, dim=1)
    count = torch.cumsum(a_sorted, dim=1)
    # A prefix of zero-importance entries has no defined scale; it cannot beat k where W_k > 0.
    objective = torch.where(count > 0, gain_num * gain_num / count.clamp_min(1e-30), 0.0)
    best = torch.argmax(objective, dim=1, keepdim=True)
    d = (torch.gather(gain_num, 1, best) / torch.gather(count, 1, best)).squeeze(1)
    keep_sorted = torch.arange(block_size, device=blocks.device).unsqueeze(0) <= best
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return d, keep


def fit_absmean(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BitNet b1.58 style, per block: ``d = mean|w|``, ``t = clamp(round(w / d), -1, 1)``.

    The baseline the report compares against. ``round`` is half-to-even (torch.round); the
    difference from half-away-from-zero only touches weights exactly at ``d/2``.
    """
    blocks = _check_blocks(blocks)
    d = to_fp16_scale(blocks.abs().mean(dim=1))
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv.unsqueeze(1)).clamp(-1, 1).to(torch.int8)
    return codes, d


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
