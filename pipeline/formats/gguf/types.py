"""The ggml block types Bonsai writes that the installed gguf-py does not fully describe.

gguf-py 0.19 knows neither ``Q2_0`` (ggml type 42, llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q2_0`` = 41)
nor any maths for ``Q1_0`` (type 41, knows its sizes only). This table carries their type id,
block size, bytes per block and the ``general.file_type`` llama.cpp writes for a file mostly in
that type (``include/llama.h``, ``ggml/include/ggml.h``, ``ggml/src/ggml-common.h`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors). Every lookup of a type by name or id goes
through `ggml_type` / `ggml_type_from_id` / `block_geometry`, which answer from this table for
the Bonsai types and from gguf-py for every other type, so code never spells a size inline.

Types gguf-py lacks are members of `ExtraGGMLType` (an IntEnum: it has a ``name`` and packs as
the integer id, which is all `gguf.GGUFWriter` needs of a raw type).

Example::

    block_geometry(ggml_type("Q2_0"))    # (64, 18)
    ggml_type_from_id(42).name           # 'Q2_0'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum, StrEnum

import gguf

__all__ = [
    "BlockType",
    "BONSAI_TYPES",
    "GGMLTypeName",
    "ExtraGGMLType",
    "ExtraFileType",
    "GGMLType",
    "FileType",
    "ggml_type",
    "ggml_type_from_id",
    "block_geometry",
    "file_type_of",
    "file_type_name",
]


class GGMLTypeName(StrEnum):
    """The ggml types the pipeline writes or chooses among, by name, as options and reports carry them.

    A StrEnum: each member is its name as a string, so JSON, comparisons and the files' own type
    names are unchanged, while code names a type as a checked member instead of spelling it.
    """

    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"
    Q8_0 = "Q8_0"
    Q6_K = "Q6_K"
    Q5_K = "Q5_K"
    Q5_0 = "Q5_0"
    Q4_K = "Q4_K"
    Q4_0 = "Q4_0"
    Q3_K = "Q3_K"
    Q2_K = "Q2_K"
    TQ2_0 = "TQ2_0"
    TQ1_0 = "TQ1_0"
    Q2_0 = "Q2_0"
    Q1_0 = "Q1_0"

    def __repr__(self) -> str:  # a message quotes a type as the string it is: 'Q2_0'
        return repr(self.value)


@dataclass(frozen=True)
class BlockType:
    """One ggml block type: ``block_size`` weights in ``type_size`` bytes.

    ``file_type_id`` / ``file_type_name``: the ``general.file_type`` (``LLAMA_FTYPE_*``) llama.cpp
    writes for a file whose weights are mostly this type.
    """

    name: str
    type_id: int
    block_size: int
    type_size: int
    file_type_id: int
    file_type_name: str

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block_size


# Q1_0: fp16 d, then 16 bytes of sign bits (128 weights). Q2_0: fp16 d, then 16 bytes of
# 2-bit codes (64 weights). Both put d first, unlike TQ1_0/TQ2_0.
BONSAI_TYPES: Mapping[str, BlockType] = {
    "Q1_0": BlockType("Q1_0", 41, 128, 18, 40, "MOSTLY_Q1_0"),
    "Q2_0": BlockType("Q2_0", 42, 64, 18, 41, "MOSTLY_Q2_0"),
}


class ExtraGGMLType(IntEnum):
    """ggml types the installed gguf-py has no member for (ids from `BONSAI_TYPES`)."""

    Q2_0 = 42


class ExtraFileType(IntEnum):
    """``LLAMA_FTYPE_*`` values the installed gguf-py has no member for."""

    MOSTLY_Q2_0 = 41


GGMLType = gguf.GGMLQuantizationType | ExtraGGMLType
FileType = gguf.LlamaFileType | ExtraFileType


def ggml_type(name: str) -> GGMLType:
    """The type named ``name`` (gguf-py's member when it has one); ValueError for an unknown name."""
    if name in gguf.GGMLQuantizationType.__members__:
        return gguf.GGMLQuantizationType[name]
    if name in ExtraGGMLType.__members__:
        return ExtraGGMLType[name]
    raise ValueError(f"unknown ggml type {name!r}")


def ggml_type_from_id(type_id: int) -> GGMLType:
    """The type with ggml id ``type_id``; ValueError for an id neither gguf-py nor this table knows."""
    try:
        return gguf.GGMLQuantizationType(type_id)
    except ValueError:
        pass
    try:
        return ExtraGGMLType(type_id)
    except ValueError:
        raise ValueError(f"unknown ggml type id {type_id}") from None


def block_geometry(qtype: GGMLType | str) -> tuple[int, int]:
    """``(weights per block, bytes per block)`` of a type; ValueError when no table has it."""
    name = qtype if isinstance(qtype, str) else qtype.name
    if name in BONSAI_TYPES:
        entry = BONSAI_TYPES[name]
        return entry.block_size, entry.type_size
    resolved = ggml_type(name)
    if not isinstance(resolved, gguf.GGMLQuantizationType) or resolved not in gguf.GGML_QUANT_SIZES:
        raise ValueError(f"no block size is known for ggml type {name}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[resolved]
    return block_size, type_size


def file_type_of(name: str) -> FileType:
    """The ``general.file_type`` member named ``name`` (``MOSTLY_Q2_0``, ``MOSTLY_TQ2_0``, ...)."""
    if name in gguf.LlamaFileType.__members__:
        return gguf.LlamaFileType[name]
    if name in ExtraFileType.__members__:
        return ExtraFileType[name]
    raise ValueError(f"unknown llama.cpp file type {name!r}")


def file_type_name(file_type_id: int) -> str:
    """Name of a ``general.file_type`` value (``MOSTLY_Q2_0`` for 41); ``UNKNOWN_<n>`` otherwise."""
    try:
        return gguf.LlamaFileType(file_type_id).name
    except ValueError:
        pass
    try:
        return ExtraFileType(file_type_id).name
    except ValueError:
        return f"UNKNOWN_{file_type_id}"
