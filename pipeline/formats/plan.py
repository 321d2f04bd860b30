"""A tensor plan: every tensor the GGUF will hold, named and shaped before any data is read."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlannedTensor"]


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor to write: where it comes from and its shape in torch order [rows, cols]."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    source_dtype: str
    shard: str
