"""The Q2_0 / Q1_0 kernel's exact paths by a full sort of each block (numba; used by `_kernel_q_impl`).

Taken for importance-weighted fits, ``levels=4``, Q1_0, and the blocks the certified window of
`_kernel_q_impl` does not cover. Every sum a candidate's objective depends on runs sequentially
in the order `fit_q` uses, and objectives are evaluated without fastmath, so the compiled fit
makes the same choices as the torch one. A file of its own only to keep modules short;
`_kernel_q_impl` stamps its numba cache with this file.
"""

# mypy: disable-error-code="no-untyped-def,no-untyped-call,call-arg,assignment"
from __future__ import annotations

import numpy as np
from numba import njit

from pipeline.ternary import _kernel_stamp
from pipeline.ternary._kernel_ir import bits_f64, f64_bits, rank16

__all__ = ["FP16_MAX", "round_fp16", "objective", "sort_desc", "scan_ternary", "scan_four", "scan_q1"]

_kernel_stamp.depends_on(__file__, "_kernel_ir.py")  # before the first cached function below

FP16_MAX = 65504.0


@njit(cache=True, inline="always")
def round_fp16(q):
    """Nearest fp16 value of float64 ``q >= 0`` (ties to even), clamped to 65504 (as `fit_q`).

    fp16 values near q are multiples of 2^(floor(log2 q) - 10) (2^-24 below 2^-14): scale by the
    inverse power of two (exact), round half to even, scale back (exact)."""
    if q >= FP16_MAX:
        return FP16_MAX
    exponent = max(((f64_bits(q) >> 52) & 0x7FF) - 1023, -14)
    inverse = bits_f64((1023 + 10 - exponent) << 52)
    step = bits_f64((1023 - 10 + exponent) << 52)
    return np.rint(q * inverse) * step


@njit(cache=True, inline="always")
def objective(num, den):
    """(``2 d A - d^2 W``, ``d``) for ``d`` = fp16(A / W): the expression `fit_q` evaluates."""
    if den <= 0.0:
        return 0.0, 0.0
    d = round_fp16(num / den)
    return 2.0 * d * num - d * d * den, d


@njit(cache=True)
def sort_desc(a, order):
    """Stable descending order of a (B a multiple of 16), by ranks: 16 comparisons at a time."""
    for j in range(a.shape[0]):
        rank = 0
        for c in range(0, a.shape[0], 16):
            rank += rank16(a, c, a[j], j)
        order[rank] = j


@njit(cache=True, inline="always")
def _weight(imp, col0, j):
    return 1.0 if imp.shape[0] == 0 else np.float64(imp[col0 + j])


@njit(cache=True)
def _score(sums, n):
    """Objective and fp16 scale of the n candidates whose sums are sums[0, :n] (A) and sums[1, :n]
    (W), into sums[2] and sums[3]: independent per candidate, so the loop vectorises (no fastmath:
    the values are those `objective` gives one by one)."""
    for m in range(n):
        g, d = objective(sums[0, m], sums[1, m])
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
def scan_ternary(a, imp, col0, order, neg, q, sums):
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
def scan_four(a, imp, col0, order, neg, q, sums, events, keys, moves):
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
def scan_q1(a, imp, col0, neg, q):
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
    return round_fp16(num / den)


