"""One codec per low-bit ggml type, registered by type name: `decompose_packed(w, "TQ2_0")`.

Each codec (`base.Codec`) packs, unpacks and fits its type; `tq` holds TQ2_0 and TQ1_0 (256
weights a block), `q` holds Q2_0 and Q1_0 (llama.cpp's sign-and-scale layouts, 64 and 128).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pipeline.ternary.codecs.base import Codec
from pipeline.ternary.codecs.q import Q1_0, Q2_0
from pipeline.ternary.codecs.tq import TQ1_0, TQ2_0

if TYPE_CHECKING:
    import torch

    from pipeline.ternary.packed import PackedMatrix

__all__ = ["Codec", "CODECS", "FITTED_TYPES", "codec_for", "decompose_packed"]

CODECS: dict[str, Codec] = {codec.name: codec for codec in (TQ2_0(), TQ1_0(), Q2_0(), Q1_0())}
FITTED_TYPES: tuple[str, ...] = tuple(CODECS)  # the types a ternary or binary fit writes


def codec_for(ggml_type: str) -> Codec:
    """The codec of ``ggml_type``; ValueError naming the types that have one."""
    try:
        return CODECS[ggml_type]
    except KeyError:
        known = ", ".join(CODECS)
        raise ValueError(f"{ggml_type!r} is not a ternary type; expected one of {known}") from None


def decompose_packed(
    w: torch.Tensor,
    ggml_type: str,
    method: str = "optimal",
    importance: torch.Tensor | None = None,
    irls_iters: int = 0,
    device: torch.device | str | None = None,
    out: npt.NDArray[np.uint8] | None = None,
    levels: int = 3,
) -> PackedMatrix:
    """``w`` ``[rows, cols]`` fitted and packed as ``ggml_type`` (TQ2_0, TQ1_0, Q2_0 or Q1_0) bytes.

    `Codec.decompose` of the type's codec: the compiled kernel on the CPU where it serves, else
    the torch fit; both give the same bytes and statistics. ``levels``: 3 or 4 (Q2_0);
    ``irls_iters``: TQ types only. Raises ValueError for a type without a codec and as
    `Codec.decompose`.
    """
    return codec_for(ggml_type).decompose(w, method, importance=importance, irls_iters=irls_iters,
                                          levels=levels, device=device, out=out)
