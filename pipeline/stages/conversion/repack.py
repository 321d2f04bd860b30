"""A ternary GGUF source's tensors moved between ternary layouts without a re-fit, where that is lossless.

A TriLM or BitNet conversion stored as TQ2_0 / TQ1_0 runs on the CPU only; re-packed as Q2_0
(the same codes, each 256-block's scale copied to its four 64-blocks) it runs on CUDA with
bit-identical decoded weights. Q2_0 goes to TQ2_0 where each 256-run shares one scale; elsewhere
the tensor is re-fitted and the report says so. Equal source and target types keep the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.repack import NotLossless, q2_0_to_tq2_0, tq_to_q2_0

__all__ = ["Repacked", "repack", "TERNARY_SOURCE_TYPES"]

TERNARY_SOURCE_TYPES = frozenset({GGMLTypeName.TQ2_0, GGMLTypeName.TQ1_0, GGMLTypeName.Q2_0})


@dataclass(frozen=True)
class Repacked:
    """The target bytes (None: a re-fit is needed) and what happened, for the tensor's report line."""

    raw: npt.NDArray[np.uint8] | None
    note: str


def repack(raw: npt.NDArray[np.uint8], source_type: str, target_type: str) -> Repacked:
    """`raw` (the source tensor's block bytes) in `target_type`, losslessly, or a reason why not."""
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if source_type == target_type:
        return Repacked(data.copy(), f"kept as stored ({source_type}, bytes unchanged)")
    if source_type in (GGMLTypeName.TQ2_0, GGMLTypeName.TQ1_0) and target_type == GGMLTypeName.Q2_0:
        return Repacked(tq_to_q2_0(data, source_type), f"re-packed losslessly from {source_type}")
    if source_type == GGMLTypeName.Q2_0 and target_type == GGMLTypeName.TQ2_0:
        try:
            return Repacked(q2_0_to_tq2_0(data), "re-packed losslessly from Q2_0")
        except NotLossless as exc:
            return Repacked(None, f"not re-packed from Q2_0 ({exc}); re-fitted")
    return Repacked(None, f"{source_type} -> {target_type} has no lossless re-packing; re-fitted")
