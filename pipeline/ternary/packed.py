"""What a decomposition hands to packaging: the GGML bytes of one matrix and how good they are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["PackedMatrix"]


@dataclass(frozen=True)
class PackedMatrix:
    """Result of `decompose_packed`: GGML bytes plus `DecomposedMatrix`'s statistics.

    ``raw``: uint8 ``[n_bytes]`` in ``ggml_type``'s block layout (a view of the caller's ``out``
    buffer when one was given); ``backend``: "kernel" (compiled CPU pass) or "torch".
    """

    raw: npt.NDArray[np.uint8]
    ggml_type: str
    method: str
    backend: str
    rel_error: float
    absmean_rel_error: float
    sparsity: float
    sq_error: float
    absmean_sq_error: float
    sq_norm: float
    n_zero: int
