"""Working a matrix a block of rows at a time, and the relative error summed over those blocks.

The lowest rung of the ternary layer: the codecs, the torch fits and the plain encodings all
chunk by `rows_per_block` and report errors through `ratio`. Nothing here loads torch or numba.
"""

from __future__ import annotations

__all__ = ["rows_per_block", "ratio"]

_BLOCK_WEIGHTS = 1 << 22  # ~4M weights (16 MB of float32) per block of rows worked on at once


def rows_per_block(cols: int) -> int:
    """Rows of ``cols`` weights handled at once where a matrix is worked on a block of rows at a time:
    the torch fits' chunks, a plain type's encode and check. Bounds the temporaries at a few
    times 16 MB whatever the matrix's size."""
    return max(1, _BLOCK_WEIGHTS // max(cols, 1))


def ratio(num: float, den: float) -> float:
    """``sqrt(num / den)``: a relative Frobenius error from squared sums (0/0 is 0, x/0 is inf)."""
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float((num / den) ** 0.5)
