"""Exact per-block fits for llama.cpp's Bonsai layouts, Q2_0 (64 weights) and Q1_0 (128), in torch.

Every fitter takes ``blocks``, float ``[n_blocks, B]`` on any device (B is 64 / 128 in files,
anything in tests), and optional ``importance`` ``a`` (non-negative, finite, broadcastable to
``blocks``; uniform when None). It returns ``(codes, scales)``: int8 ``[n_blocks, B]`` levels and
float32 ``[n_blocks]`` scales that are fp16 values, on the device of ``blocks``.

What is minimised, per block, over every level vector ``q`` of the layout and **every finite
fp16 value** ``d`` (the scale as stored, so rounding of ``d`` is part of the problem)::

    E(q, d) = sum_j a_j (w_j - d q_j)^2          (squared error, float weights w, exact reals)

- Q2_0, ``levels=3``: ``q`` in {-1, 0, +1} (ternary Bonsai; code 3 unused), ``d >= 0``.
- Q2_0, ``levels=4``: ``q`` in {-1, 0, +1, +2} and ``d`` of either sign: the grid {-1,0,1,2}·|d|
  or its mirror {-2,-1,0,1}·|d|.
- Q1_0: ``q`` in {-1, +1}, ``d >= 0``.

Why the scan below is exact. For a fixed ``d`` each weight's best level is the nearest grid
point, so the error falls from ``sum a w^2`` by ``H(d) = max_q (2 d A_q - d^2 W_q)`` with
``A_q = sum a q w`` and ``W_q = sum a q^2``. As ``|d|`` falls from infinity the nearest-level
assignment changes one weight at a time, at ``|w| = |d|/2`` (enters level ±1) and, for
``levels=4``, at ``w = 3|d|/2`` on the long side (moves to level 2). Those assignments ("events"
in order) are the only candidates: ``max over fp16 d of H(d)`` equals the maximum over them of
``2 d_q A_q - d_q^2 W_q`` with ``d_q`` = the fp16 value nearest ``A_q / W_q`` (the parabola in
``d`` is symmetric, so the nearest representable value is the best one, clamped to ±65504).
So: sort ``|w|`` (descending, stable: lower index first), accumulate ``A`` and ``W`` along the
events, round each candidate's scale to fp16 and take the best candidate. Ties in the
objective go to the earliest candidate: the empty one (all zero, ``d = 0``) first, then fewer
non-zero levels; for ``levels=4`` the grid {-1,0,1,2}·d before its mirror, and at equal event
keys an entry to level ±1 before a move to level 2. Q1_0 needs no search: ``sign(w)`` (+1 for
``w >= 0``, as llama.cpp) is optimal for every ``d > 0``, and ``d`` = fp16(A / W).

Arithmetic. Sums run in float64 in a fixed order (the events' order, sequentially, on every
device), products ``a * |w|`` of two float32 values are exact, and the candidate objective is
``2.0 * d * A - d * d * W`` evaluated left to right; the compiled kernel (`_kernel_q_impl`)
computes the same values with the same operations, so both give the same bytes. "Exact"
therefore means exact up to float64 rounding of those sums and of the objective (relative
~1e-16): two candidates closer than that are ordered by their computed values.

A block whose importance is zero everywhere has no preferred fit (every choice has ``E = 0``);
it is fitted with uniform importance instead.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.ternary.fit import FP16_MAX

__all__ = [
    "LEVELS",
    "round_to_fp16",
    "fit_q2_0",
    "fit_q1_0",
    "fit_q2_0_absmax",
    "fit_q1_0_absmean",
]

LEVELS = (3, 4)


def round_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """The fp16 value nearest each float64 ``x`` (ties to even), clamped to ±65504, as float64.

    Computed exactly (no float32 step, so no double rounding): the spacing of fp16 values
    around ``|x|`` is a power of two built from ``|x|``'s exponent, and ``|x| / spacing`` is
    rounded half to even.
    """
    x = x.to(torch.float64)
    a = x.abs()
    _, exponent = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): fp16 spacing 2^(e - 11), >= 2^-24
    bits = ((exponent.to(torch.int64) - 11).clamp_min(-24) + 1023) << 52
    spacing = bits.view(torch.float64)
    r = (torch.round(a / spacing) * spacing).clamp_max(FP16_MAX)
    return torch.where(x < 0, -r, r) + 0.0  # + 0.0: no negative zero


def _check(blocks: torch.Tensor, importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if blocks.dim() != 2 or not blocks.is_floating_point():
        raise ValueError(f"blocks must be floating point [n_blocks, block_size], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    blocks = blocks.to(torch.float32)
    if not bool(torch.isfinite(blocks).all()):
        raise ValueError("the weights hold NaN or infinite values")
    if importance is None:
        return blocks, None
    a = torch.broadcast_to(importance.to(blocks.device, torch.float32), blocks.shape)
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise ValueError("importance must be finite and non-negative")
    return blocks, a


def _sequential_cumsum(t: torch.Tensor, column_loop: bool | None = None) -> torch.Tensor:
    """Prefix sums along dim 1, each one the previous sum plus the next term (float64, any device).

    A fixed order of addition on every device: torch.cumsum on CUDA is a parallel scan whose
    rounding differs; numpy's accumulate on the CPU is sequential and fast. ``column_loop``
    (default: off the CPU) adds one column at a time in torch instead, on any device.
    """
    if not (column_loop if column_loop is not None else t.device.type != "cpu"):
        return torch.from_numpy(np.cumsum(t.contiguous().numpy(), axis=1))
    out = torch.empty_like(t)
    acc = torch.zeros_like(t[:, 0])
    for j in range(t.shape[1]):
        acc = acc + t[:, j]
        out[:, j] = acc
    return out


def _objective(num: torch.Tensor, den: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate objective ``2 d A - d^2 W``, its fp16 scale ``d``) for sums ``A``, ``W`` (float64)."""
    valid = den > 0
    d = round_to_fp16(torch.where(valid, num / torch.where(valid, den, 1.0), 0.0))
    return torch.where(valid, 2.0 * d * num - d * d * den, 0.0), d


def _best(gain: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum per row, counting the empty candidate (gain 0) as index 0."""
    full = torch.cat([torch.zeros_like(gain[:, :1]), gain], dim=1)
    return torch.argmax(full, dim=1)  # first maximum: the earliest candidate wins ties


def _sorted(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation sorting ``|w|`` descending (stable) and the sorted magnitudes as float64."""
    mag = blocks.abs()
    order = torch.sort(mag.view(torch.int32), dim=1, descending=True, stable=True).indices
    return order, torch.gather(mag, 1, order).double()


def _fit_ternary(blocks: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """levels=3: candidates are the k largest ``|w|`` (k = 0..B) with level sign(w)."""
    order, mag = _sorted(blocks)
    a_s = torch.ones_like(mag) if a is None else torch.gather(a, 1, order).double()
    gain, d = _objective(_sequential_cumsum(a_s * mag), _sequential_cumsum(a_s))
    k = _best(gain)
    scale = torch.gather(torch.cat([torch.zeros_like(d[:, :1]), d], dim=1), 1, k[:, None]).squeeze(1)
    position = torch.arange(blocks.shape[1], device=blocks.device)
    keep_sorted = (position[None, :] < k[:, None]) & (scale[:, None] > 0)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted).to(torch.int8)
    return torch.where(blocks < 0, -keep, keep), scale.to(torch.float32)


def _fit_four(blocks: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """levels=4: the grid {-1,0,1,2}·e (orientation +1) and its mirror (-1), events merged by key."""
    n, size = blocks.shape
    order, mag = _sorted(blocks)
    w_sorted = torch.gather(blocks, 1, order).double()
    a_s = torch.ones_like(mag) if a is None else torch.gather(a, 1, order).double()
    best_gain = best_scale = best_level = None
    for orientation in (1.0, -1.0):
        long_side = orientation * w_sorted > 0
        # Keys scaled by 3/2: an entry to level 1 at |w| > e/2 has key 3|w|; a move to level 2
        # at w > 3e/2 has key |w|. Entries first, then moves: a stable sort keeps that at ties.
        keys = torch.cat([3.0 * mag, torch.where(long_side, mag, -1.0)], dim=1)
        d_num = torch.cat([a_s * mag, torch.where(long_side, a_s * mag, 0.0)], dim=1)
        d_den = torch.cat([a_s, torch.where(long_side, 3.0 * a_s, 0.0)], dim=1)
        events = torch.sort(keys, dim=1, descending=True, stable=True).indices
        gain, d = _objective(_sequential_cumsum(torch.gather(d_num, 1, events)),
                             _sequential_cumsum(torch.gather(d_den, 1, events)))
        m = _best(gain)
        g = torch.gather(torch.cat([torch.zeros_like(gain[:, :1]), gain], dim=1), 1, m[:, None]).squeeze(1)
        e = torch.gather(torch.cat([torch.zeros_like(d[:, :1]), d], dim=1), 1, m[:, None]).squeeze(1)
        taken = torch.arange(2 * size, device=blocks.device)[None, :] < m[:, None]
        in_prefix = torch.zeros_like(taken).scatter_(1, events, taken)
        magnitude = in_prefix[:, :size].to(torch.int8) + in_prefix[:, size:].to(torch.int8)
        signed = torch.where(orientation * w_sorted < 0, -magnitude, magnitude)
        level = torch.zeros_like(signed).scatter_(1, order, signed)
        if best_gain is None or best_scale is None or best_level is None:
            best_gain, best_scale, best_level = g, orientation * e, level
        else:  # the mirror only when strictly better
            better = g > best_gain
            best_scale = torch.where(better, orientation * e, best_scale)
            best_level = torch.where(better[:, None], level, best_level)
    assert best_scale is not None and best_level is not None
    best_level = torch.where(best_scale[:, None] != 0, best_level, torch.zeros_like(best_level))
    return best_level, (best_scale + 0.0).to(torch.float32)


def fit_q2_0(
    blocks: torch.Tensor, importance: torch.Tensor | None = None, levels: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact Q2_0 fit (see the module docstring): levels in {-1,0,1} (``levels=3``) or {-1,0,1,2}.

    Returns int8 levels ``[n_blocks, B]`` (the Q2_0 codec stores level + 1 as the
    code) and float32 fp16-exact scales ``[n_blocks]`` (>= 0 for ``levels=3``, signed for 4).
    Raises ValueError for ``levels`` not 3 or 4, a bad shape, non-finite weights or a negative
    or non-finite importance.
    """
    if levels not in LEVELS:
        raise ValueError(f"levels={levels!r}; expected 3 or 4")
    blocks, a = _check(blocks, importance)
    fit = _fit_ternary if levels == 3 else _fit_four
    codes, scales = fit(blocks, a)
    if a is not None:
        no_weight = (a.sum(dim=1, dtype=torch.float64) == 0).nonzero().squeeze(1)
        if no_weight.numel():
            codes[no_weight], scales[no_weight] = fit(blocks[no_weight], None)
    return codes, scales


def fit_q1_0(
    blocks: torch.Tensor, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact Q1_0 fit: signs (+1 for ``w >= 0``) and ``d`` = fp16(sum a|w| / sum a), sums in index order.

    Returns int8 signs ``[n_blocks, B]`` and float32 fp16-exact scales ``[n_blocks]`` (>= 0).
    Raises ValueError like `fit_q2_0`.
    """
    blocks, a = _check(blocks, importance)
    mag = blocks.abs().double()
    codes = torch.where(blocks >= 0, 1, -1).to(torch.int8)
    num = _sequential_cumsum(mag)[:, -1]
    den = torch.full_like(num, float(blocks.shape[1]))
    if a is not None:
        a64 = a.double()
        w_num, w_den = _sequential_cumsum(a64 * mag)[:, -1], _sequential_cumsum(a64)[:, -1]
        weighted = w_den > 0
        num, den = torch.where(weighted, w_num, num), torch.where(weighted, w_den, den)
    scales = round_to_fp16(num / den) if blocks.shape[1] else torch.zeros_like(num)
    return codes, scales.to(torch.float32)


def fit_q2_0_absmax(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``quantize_row_q2_0_ref``: ``d = max|w|``, level ``roundf(w * (1/d))`` in [-1, 2].

    ``1/d`` and ``w * (1/d)`` are float32, as in C; ``roundf`` (half away from zero) is done in
    float64 on the float32 product, so it is exact. The stored ``d`` is fp16(max|w|). Its
    product never exceeds 1 in magnitude by more than an ulp, so level 2 never appears.
    """
    blocks, _ = _check(blocks, None)
    amax = blocks.abs().amax(dim=1)
    inv = torch.where(amax > 0, 1.0 / torch.where(amax > 0, amax, 1.0), 0.0).to(torch.float32)
    x = (blocks * inv[:, None]).double()
    rounded = torch.sign(x) * torch.floor(x.abs() + 0.5)
    return rounded.clamp(-1, 2).to(torch.int8), amax.to(torch.float16).to(torch.float32)


def fit_q1_0_absmean(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``quantize_row_q1_0_ref``: ``d`` = float32 running sum of ``|w|`` / B, signs ``w >= 0``.

    The sum is accumulated in float32 in index order, as the C loop does, so the stored fp16
    ``d`` is llama.cpp's bit for bit.
    """
    blocks, _ = _check(blocks, None)
    mag = blocks.abs()
    if mag.device.type == "cpu":
        total = torch.from_numpy(np.cumsum(mag.numpy(), axis=1, dtype=np.float32)[:, -1].copy())
    else:
        total = torch.zeros_like(mag[:, 0])
        for j in range(mag.shape[1]):
            total = total + mag[:, j]
    d = (total / float(blocks.shape[1])).to(torch.float16).to(torch.float32)
    return torch.where(blocks >= 0, 1, -1).to(torch.int8), d
