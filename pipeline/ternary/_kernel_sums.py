"""The float32 chain sums and exact sums above a threshold that both compiled kernels step with (numba).

``fastmath`` (reassociation, so the loops vectorise) is safe here: the float32 chain sums only
bound, and their rounding is inside each kernel's certified margin; the float64 sums are exact
in any order for the thresholds the kernels pass (every term within 2^21 of the largest). The
kernels that call these stamp their numba cache with this file (`_kernel_stamp`).
"""

# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["chain_sums_f32", "sum_above"]

_FM = {"reassoc", "nsz", "contract"}
_f32 = np.float32


@njit(cache=True, fastmath=_FM)
def chain_sums_f32(a, count, t1, t2):
    """Float32 sums and counts of a[:count] above t1 and above t2 (the chain steps' inputs)."""
    s1 = _f32(0.0)
    n1 = _f32(0.0)
    s2 = _f32(0.0)
    n2 = _f32(0.0)
    for i in range(count):
        x = a[i]
        m1 = _f32(1.0) if x > t1 else _f32(0.0)
        m2 = _f32(1.0) if x > t2 else _f32(0.0)
        s1 += x * m1
        n1 += m1
        s2 += x * m2
        n2 += m2
    return np.float64(s1), np.float64(n1), np.float64(s2), np.float64(n2)


@njit(cache=True, fastmath=_FM)
def sum_above(a, count, t):
    """Exact float64 sum (terms within 2^21 of each other) and count of a[:count] above t."""
    s = 0.0
    n = 0.0
    for i in range(count):
        x = np.float64(a[i])
        m = 1.0 if x > t else 0.0
        s += x * m
        n += m
    return s, n
