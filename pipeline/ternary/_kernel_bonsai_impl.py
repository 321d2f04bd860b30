"""The compiled CPU kernel behind `kernel_bonsai.fit_pack` (numba; see `kernel_bonsai` for the method).

One file, self-contained on purpose: numba's on-disk cache is invalidated by changes to the
file holding a cached function, not to files it calls into, so this file imports nothing
jitted from elsewhere (the TQ kernel in `_kernel_impl` stays untouched and keeps its cache;
the few LLVM-IR helpers both need are repeated here).

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
sequentially in the order `fit_bonsai` uses, and candidate objectives are evaluated without
fastmath, so the compiled fit makes the same choices as the torch one.
"""

# mypy: disable-error-code="no-untyped-def,no-untyped-call,call-arg,assignment"
from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

__all__ = ["fit_pack_bonsai_all"]

_FP16_MAX = 65504.0
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


def _host_has_avx512() -> bool:
    """AVX-512F on the host numba compiles for; never when the target CPU is overridden
    (NUMBA_CPU_NAME), since the cached code must then run on other CPUs."""
    try:
        import llvmlite.binding as llvm

        if getattr(numba.config, "CPU_NAME", None) is not None:
            return False
        return bool(llvm.get_host_cpu_features().get("avx512f", False))
    except Exception:  # pragma: no cover - unusual llvmlite builds
        return False


_REGISTER_COMPRESS = _host_has_avx512()
_V16F = ir.VectorType(ir.FloatType(), 16)
_V16I = ir.VectorType(ir.IntType(32), 16)


def _splat(builder: Any, value: Any, vec_t: Any) -> Any:
    one = builder.insert_element(ir.Constant(vec_t, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vec_t.count), [0] * vec_t.count)
    return builder.shuffle_vector(one, ir.Constant(vec_t, ir.Undefined), zeros)


@intrinsic
def _window_indices16(typingctx: Any, src: Any, i0: Any, lo: Any, hi: Any, dst: Any, pos: Any) -> Any:
    """Store the indices i in [i0, i0 + 16) with ``lo < src[i] <= hi`` (float32) at int32
    ``dst[pos:]``, in order; return ``pos`` + how many. ``dst`` needs 16 slots past ``pos``
    (with AVX-512 the compress happens in a register and all 16 lanes are stored: compressing
    straight to memory is microcoded and slow on some CPUs)."""
    sig = nbtypes.intp(src, nbtypes.intp, nbtypes.float32, nbtypes.float32, dst, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        src_v, i0_v, lo_v, hi_v, dst_v, pos_v = args
        src_data = context.make_array(signature.args[0])(context, builder, src_v).data
        ptr = builder.bitcast(builder.gep(src_data, [i0_v]), _V16F.as_pointer())
        vec = builder.load(ptr, align=4)
        mask = builder.and_(
            builder.fcmp_ordered(">", vec, _splat(builder, lo_v, _V16F)),
            builder.fcmp_ordered("<=", vec, _splat(builder, hi_v, _V16F)),
        )
        base = _splat(builder, builder.trunc(i0_v, ir.IntType(32)), _V16I)
        idx = builder.add(base, ir.Constant(_V16I, list(range(16))))
        dst_data = context.make_array(signature.args[4])(context, builder, dst_v).data
        dst_p = builder.gep(dst_data, [pos_v])
        if _REGISTER_COMPRESS:
            fn_t = ir.FunctionType(_V16I, [_V16I, _V16I, mask.type])
            fn = cgutils.get_or_insert_function(builder.module, fn_t, "llvm.x86.avx512.mask.compress.v16i32")
            packed = builder.call(fn, [idx, ir.Constant(_V16I, ir.Undefined), mask])
            builder.store(packed, builder.bitcast(dst_p, _V16I.as_pointer()), align=4)
        else:
            fn_t = ir.FunctionType(ir.VoidType(), [_V16I, dst_p.type, mask.type])
            fn = cgutils.get_or_insert_function(builder.module, fn_t, "llvm.masked.compressstore.v16i32")
            builder.call(fn, [idx, dst_p, mask])
        i16 = ir.IntType(16)
        pop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
        count = builder.zext(builder.call(pop, [builder.bitcast(mask, i16)]), ir.IntType(64))
        return builder.add(pos_v, count)

    return sig, codegen


@intrinsic
def _rank16(typingctx: Any, v: Any, c: Any, x: Any, j: Any) -> Any:
    """How many of float32 ``v[c:c+16]`` precede ``x = v[j]`` in a stable descending order
    (greater, or equal and at a lower index)."""
    sig = nbtypes.intp(v, nbtypes.intp, nbtypes.float32, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v_v, c_v, x_v, j_v = args
        data = context.make_array(signature.args[0])(context, builder, v_v).data
        vec = builder.load(builder.bitcast(builder.gep(data, [c_v]), _V16F.as_pointer()), align=4)
        xs = _splat(builder, x_v, _V16F)
        idx_t = ir.VectorType(ir.IntType(64), 16)
        lanes = builder.add(_splat(builder, c_v, idx_t), ir.Constant(idx_t, list(range(16))))
        before = builder.and_(
            builder.fcmp_ordered("==", vec, xs), builder.icmp_signed("<", lanes, _splat(builder, j_v, idx_t))
        )
        mask = builder.or_(builder.fcmp_ordered(">", vec, xs), before)
        i16 = ir.IntType(16)
        pop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
        return builder.zext(builder.call(pop, [builder.bitcast(mask, i16)]), ir.IntType(64))

    return sig, codegen


@intrinsic
def _f64_bits(typingctx: Any, x: Any) -> Any:
    """The IEEE bit pattern of a float64, as int64 (a register bitcast)."""
    sig = nbtypes.int64(nbtypes.float64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(nbtypes.int64))

    return sig, codegen


@intrinsic
def _bits_f64(typingctx: Any, b: Any) -> Any:
    """The float64 whose IEEE bit pattern is the int64 ``b``."""
    sig = nbtypes.float64(nbtypes.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(nbtypes.float64))

    return sig, codegen


@njit(cache=True, inline="always")
def _round_fp16(q):
    """Nearest fp16 value of float64 ``q >= 0`` (ties to even), clamped to 65504 (as `fit_bonsai`).

    fp16 values near q are multiples of 2^(floor(log2 q) - 10) (2^-24 below 2^-14): scale by the
    inverse power of two (exact), round half to even, scale back (exact)."""
    if q >= _FP16_MAX:
        return _FP16_MAX
    exponent = max(((_f64_bits(q) >> 52) & 0x7FF) - 1023, -14)
    inverse = _bits_f64((1023 + 10 - exponent) << 52)
    step = _bits_f64((1023 - 10 + exponent) << 52)
    return np.rint(q * inverse) * step


@njit(cache=True, inline="always")
def _objective(num, den):
    """(``2 d A - d^2 W``, ``d``) for ``d`` = fp16(A / W): the expression `fit_bonsai` evaluates."""
    if den <= 0.0:
        return 0.0, 0.0
    d = _round_fp16(num / den)
    return 2.0 * d * num - d * d * den, d


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


@njit(cache=True, fastmath=_FM)
def _chain_sums(a, t1, t2):
    """float32 sums and counts of |w| above t1 and above t2."""
    s1 = _f32(0.0)
    n1 = _f32(0.0)
    s2 = _f32(0.0)
    n2 = _f32(0.0)
    for i in range(a.shape[0]):
        x = a[i]
        m1 = _f32(1.0) if x > t1 else _f32(0.0)
        m2 = _f32(1.0) if x > t2 else _f32(0.0)
        s1 += x * m1
        n1 += m1
        s2 += x * m2
        n2 += m2
    return np.float64(s1), np.float64(n1), np.float64(s2), np.float64(n2)


@njit(cache=True, fastmath=_FM)
def _sum_above(a, t):
    """Sum (float64) and count of |w| > t; exact in any order for the thresholds used here."""
    s = 0.0
    n = 0.0
    for i in range(a.shape[0]):
        x = np.float64(a[i])
        m = 1.0 if x > t else 0.0
        s += x * m
        n += m
    return s, int(n)


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
        s1, n1, s2, n2 = _chain_sums(a, _f32(0.5) * p, _f32(0.5) * q)
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
    and none <= t_lo (see `kernel_bonsai`); (-1, inf) when no such bound is certified."""
    if not (p_lo >= _FP16_MIN_NORMAL and p_hi <= _FP16_MAX and n_lo > 0):
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
    _, n_hi = _sum_above(a, 0.5 * d_hi)
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
    s, n_top = _sum_above(a, t_hi)
    _top_levels(a, neg, q, t_hi)
    # float32 thresholds that select exactly the float32 |w| with t_lo < |w| <= t_hi (float64)
    lo = _f32_floor(t_lo)
    hi = _f32_floor(t_hi)
    n_win = 0
    for i0 in range(0, size, 16):
        n_win = _window_indices16(a, i0, lo, hi, widx, n_win)
    for i in range(1, n_win):  # stable descending insertion sort of the few in the window
        j = widx[i]
        m = i
        while m > 0 and a[widx[m - 1]] < a[j]:
            widx[m] = widx[m - 1]
            m -= 1
        widx[m] = j
    best, d_best, k_best = 0.0, 0.0, 0
    if n_top > 0:
        best, d_best = _objective(s, np.float64(n_top))
        k_best = n_top
    for m in range(n_win):
        s += np.float64(a[widx[m]])
        g, d = _objective(s, np.float64(n_top + m + 1))
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


@njit(cache=True)
def _sort_desc(a, order):
    """Stable descending order of a (B a multiple of 16), by ranks: 16 comparisons at a time."""
    for j in range(a.shape[0]):
        rank = 0
        for c in range(0, a.shape[0], 16):
            rank += _rank16(a, c, a[j], j)
        order[rank] = j


@njit(cache=True, inline="always")
def _weight(imp, col0, j):
    return 1.0 if imp.shape[0] == 0 else np.float64(imp[col0 + j])


@njit(cache=True)
def _score(sums, n):
    """Objective and fp16 scale of the n candidates whose sums are sums[0, :n] (A) and sums[1, :n]
    (W), into sums[2] and sums[3]: independent per candidate, so the loop vectorises (no fastmath:
    the values are those `_objective` gives one by one)."""
    for m in range(n):
        g, d = _objective(sums[0, m], sums[1, m])
        sums[2, m] = g
        sums[3, m] = d


@njit(cache=True, inline="always")
def _first_best(sums, n):
    """(gain, count, d) of the first candidate with the largest gain, the empty one (0) first."""
    best, m_best, d_best = 0.0, 0, 0.0
    for m in range(n):
        if sums[2, m] > best:
            best, m_best, d_best = sums[2, m], m + 1, sums[3, m]
    return best, m_best, d_best


@njit(cache=True, inline="always")
def _scan_ternary(a, imp, col0, order, neg, q, sums):
    """levels=3 by a full sort: candidates are the k largest |w|, sums in sorted order."""
    num, den = 0.0, 0.0
    for m in range(a.shape[0]):
        j = order[m]
        w = _weight(imp, col0, j)
        num += w * np.float64(a[j])
        den += w
        sums[0, m] = num
        sums[1, m] = den
    _score(sums, a.shape[0])
    _, k_best, d_best = _first_best(sums, a.shape[0])
    for i in range(a.shape[0]):
        q[i] = 0
    if d_best > 0.0:
        for m in range(k_best):
            q[order[m]] = -1 if neg[order[m]] else 1
    return d_best


@njit(cache=True, inline="always")
def _long(a, neg, j, orientation):
    """w_j lies on the side of the grid with level 2 (orientation * w > 0)."""
    return a[j] > 0 and (neg[j] if orientation < 0 else not neg[j])


@njit(cache=True, inline="always")
def _merge(a, imp, col0, order, neg, orientation, sums, events, keys, moves):
    """Score every prefix of the levels=4 events of one orientation, in order: entries to level
    1 (key 3|w|, every weight, in sorted order) merged with moves to level 2 (key |w|, the long
    side's weights), entries first at equal keys. Branch-free: sentinel keys (-1) end each list.
    Records each event's weight in ``events``; returns (gain, count, d) of the best prefix."""
    size = a.shape[0]
    n_moves = 0
    for m in range(size):
        moves[n_moves] = m
        n_moves += _long(a, neg, order[m], orientation)
    for m in range(size):
        keys[0, m] = 3.0 * np.float64(a[order[m]])
    keys[0, size] = -1.0
    for u in range(n_moves):
        keys[1, u] = np.float64(a[order[moves[u]]])
    keys[1, n_moves] = -1.0
    ie, iu, num, den = 0, 0, 0.0, 0.0
    for t in range(size + n_moves):
        entry = np.int64(keys[0, ie] >= keys[1, iu])
        j = order[entry * ie + (1 - entry) * moves[iu]]
        w = _weight(imp, col0, j)
        num += w * np.float64(a[j])
        den += w * (3.0 - 2.0 * entry)
        ie += entry
        iu += 1 - entry
        sums[0, t] = num
        sums[1, t] = den
        events[t] = j
    _score(sums, size + n_moves)
    return _first_best(sums, size + n_moves)


@njit(cache=True, inline="always")
def _scan_four(a, imp, col0, order, neg, q, sums, events, keys, moves):
    """levels=4: the grid {-1,0,1,2}·e, then its mirror only if strictly better; returns signed d."""
    g_pos, m_pos, d_pos = _merge(a, imp, col0, order, neg, 1, sums, events[0], keys, moves)
    g_neg, m_neg, d_neg = _merge(a, imp, col0, order, neg, -1, sums, events[1], keys, moves)
    mirror = g_neg > g_pos
    d, n_taken, chosen = (-d_neg, m_neg, events[1]) if mirror else (d_pos, m_pos, events[0])
    for i in range(a.shape[0]):
        q[i] = 0
    if d == 0.0:
        return 0.0
    for t in range(n_taken):
        q[chosen[t]] += 1
    for i in range(a.shape[0]):  # the short side's weights take negative levels
        short = (not neg[i] and a[i] > 0) if mirror else neg[i]
        if short:
            q[i] = -q[i]
    return d


@njit(cache=True, inline="always")
def _scan_q1(a, imp, col0, neg, q):
    """Q1_0: signs, and d = fp16(sum a|w| / sum a) summed in index order (uniform if sum a = 0)."""
    num = 0.0
    den = 0.0
    if imp.shape[0] != 0:
        for i in range(a.shape[0]):
            w = np.float64(imp[col0 + i])
            num += w * np.float64(a[i])
            den += w
    if den <= 0.0:
        num = 0.0
        for i in range(a.shape[0]):
            num += np.float64(a[i])
        den = np.float64(a.shape[0])
    for i in range(a.shape[0]):
        q[i] = -1 if neg[i] else 1
    return _round_fp16(num / den)


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
    d_am = _round_fp16(sa / size)
    if is_q1:
        d = _scan_q1(a, imp, col0, neg, q)
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
            _sort_desc(a, order)
            if levels == 3:
                d = _scan_ternary(a, imp_used, col0, order, neg, q, sums)
            else:
                d = _scan_four(a, imp_used, col0, order, neg, q, sums, events, keys, moves)
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
def fit_pack_bonsai_all(src, shift, imp, n_per_row, out, stats, chunk, is_q1, levels, block_bytes):
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
