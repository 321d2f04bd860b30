"""Q2_0/Q1_0 numba kernel, a file of its own: numba's disk cache follows the file that defines it.

The compiled CPU pass behind the Q codecs (`codecs.q` explains the method). An edit to the TQ
kernel leaves this one's cache valid. The sorting paths live in `_kernel_q_sorted`, the vector
steps in `_kernel_ir` and the sums in `_kernel_sums`; `_kernel_stamp` adds all three to this
file's cache stamp.

Speed notes (a 64-weight block leaves little to amortise a call over): orchestration
functions are inlined at numba's level (``inline="always"``), but never the ``fastmath``
loops, which would lose their flags and their vectorisation; the window is compacted and
blocks sorted with 16-lane compares (AVX-512 register compress where numba compiles for a
host that has it, LLVM's generic compress-store elsewhere); candidates are scored in a loop
LLVM vectorises; the levels=4 merge is branch-free.

Sums flagged ``fastmath`` (reassociation, so they vectorise) are only ones whose value does
not depend on the order of addition or that only bound or report: chain sums (their rounding
is inside the certified margin), the top sum (exact: every term is within 2^8 of the largest),
``sum w^2`` and the error totals. Every sum a candidate's objective depends on otherwise runs
sequentially in the order `fit_q` uses, and candidate objectives are evaluated without
fastmath, so the compiled fit makes the same choices as the torch one.
"""

# mypy: disable-error-code="no-untyped-def,no-untyped-call,call-arg,assignment"
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from pipeline.ternary import _kernel_stamp
from pipeline.ternary._kernel_ir import compress_index16
from pipeline.ternary._kernel_q_sorted import (
    FP16_MAX,
    objective,
    round_fp16,
    scan_four,
    scan_q1,
    scan_ternary,
    sort_desc,
)
from pipeline.ternary._kernel_sums import chain_sums_f32, sum_above

__all__ = ["fit_pack_all"]

# Before the first cached function below.
_kernel_stamp.depends_on(__file__, "_kernel_ir.py", "_kernel_q_sorted.py", "_kernel_sums.py")

_FP16_MIN_NORMAL = 6.103515625e-05  # 2^-14
_DELTA = 1.0 / 64  # chain steps stop this far short of the mean's half
_CERTIFIED = _DELTA / 2  # slope margin they certify, after float32 rounding of the chain sums
_ROUNDING = 2.0**-22  # (fp16 half-spacing / value)^2 for normal fp16 scales
_MARGIN = 2.0**-30  # extra gap, relative to sum w^2, far above float64 rounding of objectives
_F32_LO = 2.0**-60  # chains run in float32 while max |w| lies in [2^-60, 2^60]
_F32_HI = 2.0**60
_MAX_CHAIN_STEPS = 200
_FM = {"reassoc", "nsz", "contract"}
_f32 = np.float32


@njit(cache=True, inline="always")
def _fp16_bits(d, tmp, tmpf):
    """IEEE half bit pattern of an fp16-exact float64 ``d`` (either sign)."""
    sign = 0x8000 if d < 0 else 0
    m = abs(d)
    if m < _FP16_MIN_NORMAL:
        return sign | int(m * 16777216.0)
    tmpf[0] = _f32(m)
    b = tmp[0]
    return sign | (((b >> 23) - 112) << 10) | ((b >> 13) & 0x3FF)


@njit(cache=True, fastmath=_FM)
def _load(src, r, shift, ab, neg):
    """Row r of src (float32 patterns, shift 0; bfloat16 ones, shift 16) -> patterns of |w| in ``ab``,
    ``neg[i]`` = w < 0. Returns the largest pattern (>= 0x7F800000: inf or NaN)."""
    mb = np.int32(0)
    for i in range(ab.shape[0]):
        full = np.int32(np.int64(src[r, i]) << shift)
        v = full & np.int32(0x7FFFFFFF)
        ab[i] = v
        neg[i] = (full < 0) and (v != 0)
        mb = max(mb, v)
    return mb


@njit(cache=True, fastmath=_FM)
def _moments(a):
    """sum |w| and sum w^2 (float64, any order: they bound and report, never choose)."""
    sa = 0.0
    sq = 0.0
    for i in range(a.shape[0]):
        x = np.float64(a[i])
        sa += x
        sq += x * x
    return sa, sq


@njit(cache=True, inline="always")
def _chains(a, mean, mx):
    """Certified bracket [p_lo, p_hi] of every maximiser of H(d) (uniform importance), and
    #{|w| > p_lo / 2}. Up from mean |w|, H rises with slope >= 2 N(d/2) d _CERTIFIED; down from
    max |w| it falls as steeply. Steps and thresholds are float32, so halving them is exact."""
    p = _f32(mean * (1.0 - _DELTA))
    q = _f32(mx)
    up_done = False
    down_done = False
    n_lo = 0.0
    for _ in range(_MAX_CHAIN_STEPS):
        s1, n1, s2, n2 = chain_sums_f32(a, a.shape[0], _f32(0.5) * p, _f32(0.5) * q)
        if not up_done:
            nxt = _f32((s1 / n1) * (1.0 - _DELTA))
            if nxt <= p:
                up_done = True
                n_lo = n1
            else:
                p = nxt
        if not down_done:
            nxt = _f32((s2 / n2) * (1.0 + _DELTA))
            if nxt >= q:
                down_done = True
            else:
                q = nxt
        if up_done and down_done:
            return np.float64(p), np.float64(q), n_lo, True
    return 0.0, 0.0, 0.0, False


@njit(cache=True, inline="always")
def _window(a, mx, sq, p_lo, p_hi, n_lo):
    """Thresholds (t_lo, t_hi): every candidate that can reach the fp16 optimum keeps all |w| > t_hi
    and none <= t_lo (see `codecs.q`); (-1, inf) when no such bound is certified."""
    if not (p_lo >= _FP16_MIN_NORMAL and p_hi <= FP16_MAX and n_lo > 0):
        return -1.0, np.inf
    slack = sq * (_ROUNDING + _MARGIN) * (1.0 + 1e-9)
    lo_sq = p_lo * p_lo - slack / (_CERTIFIED * n_lo)
    if lo_sq <= 0.0:
        return -1.0, np.inf
    d_lo = math.sqrt(lo_sq) * (1.0 - 1e-9)
    t_lo = 0.5 * (d_lo - slack / d_lo) * (1.0 - 1e-9)
    if t_lo <= 0.0:
        return -1.0, np.inf
    d_hi = p_hi * (1.0 + 2.0**-8)
    if d_hi >= mx:
        return t_lo, np.inf
    _, n_hi = sum_above(a, a.shape[0], 0.5 * d_hi)
    if _CERTIFIED * n_hi * (d_hi * d_hi - p_hi * p_hi) <= slack * (1.0 + 1e-6):
        return t_lo, np.inf
    return t_lo, 0.5 * (d_hi + slack / d_lo) * (1.0 + 1e-9)


@njit(cache=True, inline="always")
def _fit_window(a, neg, q, mx, sq, sa, widx):
    """levels=3, uniform importance, by the certified window. Writes levels to q; returns
    (d, handled): handled is False when no window is certified (the caller sorts instead)."""
    size = a.shape[0]
    if not (mx >= _F32_LO and mx <= _F32_HI):
        return 0.0, False
    p_lo, p_hi, n_lo, ok = _chains(a, sa / size, mx)
    if not ok:
        return 0.0, False
    t_lo, t_hi = _window(a, mx, sq, min(p_lo, p_hi), max(p_lo, p_hi), n_lo)
    if t_lo < 0.0:
        return 0.0, False
    s, n_above = sum_above(a, a.shape[0], t_hi)
    n_top = int(n_above)
    _top_levels(a, neg, q, t_hi)
    # float32 thresholds that select exactly the float32 |w| with t_lo < |w| <= t_hi (float64)
    lo = _f32_floor(t_lo)
    hi = _f32_floor(t_hi)
    n_win = 0
    for i0 in range(0, size, 16):
        n_win = compress_index16(a, i0, lo, hi, widx, n_win)
    for i in range(1, n_win):  # stable descending insertion sort of the few in the window
        j = widx[i]
        m = i
        while m > 0 and a[widx[m - 1]] < a[j]:
            widx[m] = widx[m - 1]
            m -= 1
        widx[m] = j
    best, d_best, k_best = 0.0, 0.0, 0
    if n_top > 0:
        best, d_best = objective(s, np.float64(n_top))
        k_best = n_top
    for m in range(n_win):
        s += np.float64(a[widx[m]])
        g, d = objective(s, np.float64(n_top + m + 1))
        if g > best:
            best, d_best, k_best = g, d, n_top + m + 1
    for m in range(k_best - n_top):
        q[widx[m]] = -1 if neg[widx[m]] else 1
    if d_best == 0.0:
        for i in range(size):
            q[i] = 0
    return d_best, True


@njit(cache=True, fastmath=_FM)
def _top_levels(a, neg, q, t_hi):
    """q = sign(w) (w < 0: -1) where |w| > t_hi, else 0."""
    for i in range(a.shape[0]):
        top = np.int8(np.float64(a[i]) > t_hi)
        q[i] = top - np.int8(2) * (top & np.int8(neg[i]))


@njit(cache=True, inline="always")
def _f32_floor(t):
    """The largest float32 f <= t (float64): for float32 x, x > f exactly when x > t, and
    x <= f exactly when x <= t."""
    f = _f32(t)
    return f if np.float64(f) <= t else np.nextafter(f, _f32(-np.inf))


@njit(cache=True, fastmath=_FM)
def _errors(a, neg, q, d, d_am, is_q1):
    """Squared error of the fit and of the absmean baseline, and the non-zero count (float64)."""
    err = 0.0
    err_am = 0.0
    nnz = 0
    for i in range(a.shape[0]):
        x = np.float64(a[i])
        w = -x if neg[i] else x
        e = w - d * np.float64(q[i])
        err += e * e
        nnz += q[i] != 0
        if is_q1 or x > 0.5 * d_am:
            e_am = x - d_am
        else:
            e_am = x
        err_am += e_am * e_am
    return err, err_am, nnz


@njit(cache=True, inline="always")
def _pack(q, d, out, base, is_q1, tmp, tmpf):
    bits = _fp16_bits(d, tmp, tmpf)
    out[base] = bits & 0xFF
    out[base + 1] = bits >> 8
    if is_q1:
        for m in range(16):
            byte = 0
            for b in range(8):
                byte |= (1 if q[8 * m + b] > 0 else 0) << b
            out[base + 2 + m] = byte
    else:
        for m in range(16):
            byte = 0
            for b in range(4):
                byte |= (np.int64(q[4 * m + b]) + 1) << (2 * b)
            out[base + 2 + m] = byte


@njit(cache=True, inline="always")
def _fit_block(src, r, shift, imp, n_per_row, is_q1, levels, ab, a, neg, q, order, tmp, tmpf, out, base, sums,
               events, keys, moves):
    """Block r: its bytes at out[base:]; returns (error, absmean error, sum w^2, non-zero, bad)."""
    size = a.shape[0]
    mb = _load(src, r, shift, ab, neg)
    if mb >= 0x7F800000:
        return 0.0, 0.0, 0.0, 0, True
    sa, sq = _moments(a)
    col0 = (r % n_per_row) * size
    d_am = round_fp16(sa / size)
    if is_q1:
        d = scan_q1(a, imp, col0, neg, q)
    elif mb == 0:
        d = 0.0
        for i in range(size):
            q[i] = 0
    else:
        handled = False
        d = 0.0
        if levels == 3 and imp.shape[0] == 0:
            d, handled = _fit_window(a, neg, q, _max(a), sq, sa, order)
        if not handled:
            if imp.shape[0] != 0 and _no_weight(imp, col0, size):
                imp_used = imp[:0]
            else:
                imp_used = imp
            sort_desc(a, order)
            if levels == 3:
                d = scan_ternary(a, imp_used, col0, order, neg, q, sums)
            else:
                d = scan_four(a, imp_used, col0, order, neg, q, sums, events, keys, moves)
    err, err_am, nnz = _errors(a, neg, q, d, d_am, is_q1)
    _pack(q, d, out, base, is_q1, tmp, tmpf)
    return err, err_am, sq, nnz, False


@njit(cache=True, fastmath=_FM)
def _max(a):
    m = _f32(0.0)
    for i in range(a.shape[0]):
        m = max(m, a[i])
    return np.float64(m)


@njit(cache=True, inline="always")
def _no_weight(imp, col0, size):
    total = 0.0
    for i in range(size):
        total += np.float64(imp[col0 + i])
    return total == 0.0


@njit(cache=True, parallel=True, nogil=True)
def fit_pack_all(src, shift, imp, n_per_row, out, stats, chunk, is_q1, levels, block_bytes):
    """Every block of src ([n_blocks, B]) into out, chunks of blocks in parallel; per chunk c,
    stats[c, :5] = (error, absmean error, sum w^2, non-zero levels, non-finite blocks).

    ``imp``: float32 importance per column ([n_per_row * B]), or empty for uniform."""
    n_blocks = src.shape[0]
    size = src.shape[1]
    for c in prange(stats.shape[0]):
        ab = np.empty(size, np.int32)
        a = ab.view(np.float32)
        neg = np.empty(size, np.bool_)
        q = np.empty(size, np.int8)
        order = np.empty(size + 16, np.int32)
        tmp = np.empty(1, np.int32)
        tmpf = tmp.view(np.float32)
        sums = np.empty((4, 2 * size))  # candidates' A, W, objective, d (full-sort paths)
        events = np.empty((2, 2 * size), np.int64)  # levels=4: each event's weight, per orientation
        keys = np.empty((2, size + 1))
        moves = np.empty(size + 1, np.int64)
        e_opt, e_am, e_sq, nnz, n_bad = 0.0, 0.0, 0.0, 0, 0
        for r in range(c * chunk, min(n_blocks, (c + 1) * chunk)):
            e1, e2, e3, k, bad = _fit_block(src, r, shift, imp, n_per_row, is_q1, levels, ab, a, neg, q,
                                            order, tmp, tmpf, out, r * block_bytes, sums, events, keys, moves)
            e_opt += e1
            e_am += e2
            e_sq += e3
            nnz += k
            n_bad += bad
        stats[c, 0] = e_opt
        stats[c, 1] = e_am
        stats[c, 2] = e_sq
        stats[c, 3] = nnz
        stats[c, 4] = n_bad
