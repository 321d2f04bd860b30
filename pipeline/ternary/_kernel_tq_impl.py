"""TQ2_0/TQ1_0 numba kernel, a file of its own: numba's disk cache follows the file that defines it.

The compiled CPU pass behind the TQ codecs (`codecs.tq` explains the method). An edit to the
Q2_0 / Q1_0 kernel leaves this one's cache valid; the vector steps and sums it inlines live in
`_kernel_ir` and `_kernel_sums`, which `_kernel_stamp` adds to its cache stamp.

Sums flagged ``fastmath`` (reassociation, so they vectorise) are only ones whose result does
not depend on the order of addition: float64 sums of float32 values within a factor 2^21 of
each other, counts, and float32 sums whose rounding the chain steps allow for.
"""

# mypy: disable-error-code="no-untyped-def,no-untyped-call,call-arg"
from __future__ import annotations

import numpy as np
from numba import njit, prange

from pipeline.ternary import _kernel_stamp
from pipeline.ternary._kernel_ir import compress16, pack_tq1, pack_tq2, rank16
from pipeline.ternary._kernel_sums import chain_sums_f32, sum_above

__all__ = ["fit_pack_all", "QK"]

# Before the first cached function below.
_kernel_stamp.depends_on(__file__, "_kernel_ir.py", "_kernel_sums.py")

QK = 256
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 6.103515625e-05  # 2^-14
_DELTA = 4e-5  # > 2 x the worst relative error of a float32 sum of 256 non-negative terms
_EPS = 1e-6  # margin for counts whose float64 objective is within rounding of the optimum
_NEAR_EXACT = 1e-6  # errors below this fraction of sum w^2 are summed directly
_F32_SAFE_LO = 2.0**-100  # max |w| outside [2^-100, 2^119]: chain sums in float64 (no overflow)
_F32_SAFE_HI = 2.0**119
_FULL_STEPS = 3  # chain steps over the whole block before the weights left between are kept
_SORT_AT = 32  # keep stepping over the kept weights until at most this many are left
_FM = {"reassoc", "nsz", "contract"}
_f32 = np.float32


@njit(cache=True, inline="always")
def _as_bits(value, tmp, tmpf):
    tmpf[0] = value
    return tmp[0]


@njit(cache=True, inline="always")
def _as_f64(pattern, tmp, tmpf):
    tmp[0] = pattern
    return np.float64(tmpf[0])


@njit(cache=True, inline="always")
def _fp16_round(x, tmp, tmpf):
    """Nearest fp16 value (ties to even) of a non-negative float32 value, clamped to 65504."""
    if x >= _FP16_MAX:
        return _FP16_MAX
    if x < _FP16_MIN_NORMAL:  # fp16 subnormals: a fixed step of 2^-24
        return float(np.rint(x * 16777216.0) / 16777216.0)
    b = _as_bits(_f32(x), tmp, tmpf)  # drop 13 of float32's 23 fraction bits, ties to even
    return _as_f64((b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF, tmp, tmpf)


@njit(cache=True, inline="always")
def _fp16_bits(d, tmp, tmpf):
    """IEEE half bit pattern of a non-negative fp16-exact value."""
    if d < _FP16_MIN_NORMAL:
        return int(d * 16777216.0)
    b = _as_bits(_f32(d), tmp, tmpf)
    return (((b >> 23) - 112) << 10) | ((b >> 13) & 0x3FF)


@njit(cache=True, fastmath=_FM)
def _load(src, r, shift, sb, ab, a):
    """Row r of ``src`` (float32 bit patterns as int32, shift 0; or bfloat16 ones as uint16,
    shift 16) into ``sb`` (signed float32 patterns) and ``ab`` (patterns of |w|, ordered like
    the values; ``a`` is the same memory as float32). Returns the largest pattern (inf or NaN
    when >= 0x7F800000), sum |w| and sum w^2."""
    mb = np.int32(0)
    for i in range(ab.shape[0]):
        full = np.int32(np.int64(src[r, i]) << shift)
        sb[i] = full
        v = full & np.int32(0x7FFFFFFF)
        ab[i] = v
        mb = max(mb, v)
    sa = 0.0
    sq = 0.0
    for i in range(a.shape[0]):
        x = np.float64(a[i])
        sa += x
        sq += x * x
    return mb, sa, sq


@njit(cache=True, fastmath=_FM)
def _pass_f32(a, count, t1, t2, t_am):
    """Float32 sums and counts of a[:count] above t1 and t2; exact float64 sum and count above t_am."""
    s1 = _f32(0.0)
    n1 = _f32(0.0)
    s2 = _f32(0.0)
    n2 = _f32(0.0)
    sm = 0.0
    nm = 0.0
    for i in range(count):
        x = a[i]
        m1 = _f32(1.0) if x > t1 else _f32(0.0)
        m2 = _f32(1.0) if x > t2 else _f32(0.0)
        mm = 1.0 if x > t_am else 0.0
        s1 += x * m1
        n1 += m1
        s2 += x * m2
        n2 += m2
        sm += np.float64(x) * mm
        nm += mm
    return np.float64(s1), np.float64(n1), np.float64(s2), np.float64(n2), sm, nm


@njit(cache=True, fastmath=_FM)
def _pass_f64(a, count, t1, t2, t_am):
    """`_pass_f32` with float64 sums throughout, for blocks whose float32 sums could overflow."""
    s1 = 0.0
    n1 = 0.0
    s2 = 0.0
    n2 = 0.0
    sm = 0.0
    nm = 0.0
    for i in range(count):
        x = np.float64(a[i])
        m1 = 1.0 if x > t1 else 0.0
        m2 = 1.0 if x > t2 else 0.0
        mm = 1.0 if x > t_am else 0.0
        s1 += x * m1
        n1 += m1
        s2 += x * m2
        n2 += m2
        sm += x * mm
        nm += mm
    return s1, n1, s2, n2, sm, nm


@njit(cache=True, inline="always")
def _chain_step(s, n, t, n_prev, up):
    """One certified step of a chain at threshold t, from the sum s and count n of {x > t}:
    (next threshold, its count, whether the chain has stopped). Steps fall 4e-5 short of the
    mean's half, which covers the rounding of float32 sums."""
    if up:
        nxt = _f32(0.5 * (s / n) * (1.0 - _DELTA))
        if n == n_prev or nxt <= t:
            return t, n_prev, True
    else:
        nxt = _f32(0.5 * (s / n) * (1.0 + _DELTA))
        if n == n_prev or nxt >= t:
            return t, n_prev, True
    return nxt, n, False


@njit(cache=True, inline="always")
def _compact(src, count, lo, hi, dst):
    """The x of src[:count] with lo < x <= hi, in order, to dst (which may be src); how many.
    Reads whole 16-lane groups: src needs padding past count that fails the test."""
    pos = 0
    for i0 in range(0, count, 16):
        pos = compress16(src, i0, lo, hi, dst, pos)
    return pos


@njit(cache=True, inline="always")
def _pad16(v, count):
    for i in range(count, (count + 15) & ~15):
        v[i] = -1.0


@njit(cache=True, inline="always")
def _sort_desc(v, count, out):
    """Stable descending sort of non-negative v[:count] into out, by ranks: branch-free, faster
    than a comparison sort for the dozen or so values it gets."""
    _pad16(v, count)
    for j in range(count):
        rank = 0
        for c in range(0, count, 16):
            rank += rank16(v, c, v[j], j)
        out[rank] = v[j]


@njit(cache=True, inline="always")
def _chain_sums(a, count, tl, tu, wide):
    if wide:
        s1, n1, s2, n2, _, _ = _pass_f64(a, count, np.float64(tl), np.float64(tu), np.inf)
        return s1, n1, s2, n2
    return chain_sums_f32(a, count, tl, tu)


@njit(cache=True, inline="always")
def _select(a, act, srt, m, sa, t_am, tmp, tmpf):
    """Exact first maximiser k of S_k^2 / k for the block |w| = a (see `kernel`).

    Returns (k, S_k, thr, need, s_am, n_am): keep the weights whose |w| pattern is >= thr, or,
    when need >= 0 (an optimal set that splits equal weights), those > thr and the first
    ``need`` equal to it; s_am, n_am: exact sum and count of |w| > t_am (the absmean codes).
    """
    wide = not (m >= _F32_SAFE_LO and m <= _F32_SAFE_HI)
    tl = _f32(0.5 * (sa / a.shape[0]) * (1.0 - _DELTA))
    tu = _f32(0.5 * m)
    nl, nu, done_l, done_u = -1.0, -1.0, False, False
    if wide:
        s1, n1, s2, n2, s_am, n_am = _pass_f64(
            a, a.shape[0], np.float64(tl), np.float64(tu), np.float64(t_am)
        )
    else:
        s1, n1, s2, n2, s_am, n_am = _pass_f32(a, a.shape[0], tl, tu, t_am)
    for step in range(_FULL_STEPS):
        if step > 0:
            s1, n1, s2, n2 = _chain_sums(a, a.shape[0], tl, tu, wide)
        if not done_l:
            tl, nl, done_l = _chain_step(s1, n1, tl, nl, True)
        if not done_u:
            tu, nu, done_u = _chain_step(s2, n2, tu, nu, False)
        if done_l and done_u:
            break
    # Every optimal set keeps all weights above tu and none below tl: keep those in between
    # (with 2 eps of float64 slack) and the exact sum of those above.
    c_lo = _f32(min(tl, tu) * (1.0 - 2.0 * _EPS))
    c_hi = _f32(max(tl, tu) * (1.0 + 2.0 * _EPS))
    n_act = _compact(a, a.shape[0], c_lo, c_hi, act)
    s_top, n_top = sum_above(a, a.shape[0], np.float64(c_hi))
    while n_act > _SORT_AT and not (done_l and done_u):  # unusual blocks: step on the few kept
        base = s_top if wide else np.float64(_f32(s_top))
        s1, n1, s2, n2 = _chain_sums(act, n_act, tl, tu, wide)
        if not done_l:
            tl, nl, done_l = _chain_step(base + s1, n_top + n1, tl, nl, True)
        if not done_u:
            tu, nu, done_u = _chain_step(base + s2, n_top + n2, tu, nu, False)
        c_lo = _f32(min(tl, tu) * (1.0 - 2.0 * _EPS))
        c_hi = _f32(max(tl, tu) * (1.0 + 2.0 * _EPS))
        s_up, n_up = sum_above(act, n_act, np.float64(c_hi))
        s_top += s_up
        n_top += n_up
        _pad16(act, n_act)
        n_act = _compact(act, n_act, c_lo, c_hi, act)
    _sort_desc(act, n_act, srt)
    # Candidates are prefixes of the kept weights in descending order: k rises by one.
    s = s_top
    k = int(n_top)
    best = s * s / k if k > 0 else -1.0
    bk, bs, bj = k, s, -1
    for j in range(n_act):
        s += np.float64(srt[j])
        k += 1
        f = s * s / k
        if f > best:
            best, bk, bs, bj = f, k, s, j
    if bj < 0:
        return bk, bs, _as_bits(c_hi, tmp, tmpf) + 1, -1, s_am, int(n_am)
    v = srt[bj]
    first = bj
    while first > 0 and srt[first - 1] == v:
        first -= 1
    last = bj
    while last + 1 < n_act and srt[last + 1] == v:
        last += 1
    need = -1 if bj == last else bj - first + 1
    return bk, bs, _as_bits(v, tmp, tmpf), need, s_am, int(n_am)


@njit(cache=True, inline="always")
def _codes_thr(sb, ab, thr, q):
    """Codes 0/1/2 into q: the weights with |w| pattern >= thr get 1 + sign, the others 1."""
    for i in range(QK):
        keep = np.int32(ab[i] >= thr)
        q[i] = np.uint8(1 + keep * (1 + 2 * (sb[i] >> 31)))


@njit(cache=True, inline="always")
def _codes_ties(sb, ab, thr, need, q):
    """Codes with pattern > thr kept, plus the first ``need`` equal to thr (index order)."""
    seen = 0
    for i in range(QK):
        keep = ab[i] > thr
        if ab[i] == thr:
            keep = seen < need
            seen += 1
        q[i] = (0 if sb[i] < 0 else 2) if keep else 1


@njit(cache=True, fastmath=_FM)
def _direct_sq_error(sb, a, q, d):
    """sum (w - d t)^2 in float64, term by term."""
    e = 0.0
    for i in range(QK):
        w = np.float64(a[i]) if sb[i] >= 0 else -np.float64(a[i])
        x = w - d * (np.int32(q[i]) - 1)
        e += x * x
    return e


@njit(cache=True, inline="always")
def fit_block(src, r, shift, sb, ab, a, act, srt, q, tmp, tmpf, out, base, is_tq1):
    """Block r of src: its bytes at out[base:]; returns (error, absmean error, sum w^2, k, bad)."""
    mb, sa, sq = _load(src, r, shift, sb, ab, a)
    if mb >= 0x7F800000:  # inf or NaN
        return 0.0, 0.0, 0.0, 0, True
    dam = _fp16_round(np.float64(_f32(sa / QK)), tmp, tmpf)
    t_am = _f32(0.5 * dam)
    d, k, s_k, thr, need, s_am, n_am = 0.0, 0, 0.0, np.int32(0x7FFFFFFF), -1, 0.0, 0
    if mb > 0:
        k, s_k, thr, need, s_am, n_am = _select(a, act, srt, _as_f64(mb, tmp, tmpf), sa, t_am, tmp, tmpf)
        d = _fp16_round(np.float64(_f32(s_k / k)), tmp, tmpf)
    if d == 0.0:  # all zero, or a scale that underflows fp16: nothing kept
        k, s_k, thr, need = 0, 0.0, np.int32(0x7FFFFFFF), -1
    # S_k and d are exact, so these lose nothing but float64 rounding of sum w^2 ...
    err = max(sq - 2.0 * d * s_k + d * d * k, 0.0)
    err_am = max(sq - 2.0 * dam * s_am + dam * dam * n_am, 0.0)
    if need >= 0:
        _codes_ties(sb, ab, thr, need, q)
    else:
        _codes_thr(sb, ab, thr, q)
    # ... which matters only where the error is a tiny part of it: sum those term by term.
    if err < _NEAR_EXACT * sq:
        err = _direct_sq_error(sb, a, q, d)
    if is_tq1:
        pack_tq1(q, out, base)
    else:
        pack_tq2(q, out, base)
    if err_am < _NEAR_EXACT * sq:
        _codes_thr(sb, ab, _as_bits(t_am, tmp, tmpf) + 1, q)
        err_am = _direct_sq_error(sb, a, q, dam)
    fb = _fp16_bits(d, tmp, tmpf)
    nb = 54 if is_tq1 else 66
    out[base + nb - 2] = fb & 0xFF
    out[base + nb - 1] = fb >> 8
    return err, err_am, sq, k, False


@njit(cache=True, parallel=True, nogil=True)
def fit_pack_all(src, shift, out, stats, chunk, is_tq1):
    """Every block of src ([n_blocks, 256]) into out, chunks of blocks in parallel; per chunk c,
    stats[c, :5] = (error, absmean error, sum w^2, non-zero codes, non-finite blocks)."""
    n_blocks = src.shape[0]
    block_bytes = 54 if is_tq1 else 66
    for c in prange(stats.shape[0]):
        sb = np.empty(QK, np.int32)
        ab = np.empty(QK, np.int32)
        a = ab.view(np.float32)
        act = np.empty(QK + 16, np.float32)
        srt = np.empty(QK, np.float32)
        q = np.empty(QK, np.uint8)
        tmp = np.empty(1, np.int32)
        tmpf = tmp.view(np.float32)
        e_opt, e_am, e_sq, nnz, n_bad = 0.0, 0.0, 0.0, 0, 0
        for r in range(c * chunk, min(n_blocks, (c + 1) * chunk)):
            e1, e2, e3, k, bad = fit_block(
                src, r, shift, sb, ab, a, act, srt, q, tmp, tmpf, out, r * block_bytes, is_tq1
            )
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
