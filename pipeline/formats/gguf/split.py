"""llama.cpp's own split format: `<stem>-00001-of-0000N.gguf`, loadable from the first file.

As `llama-gguf-split --split --split-max-size` does it: tensors keep their order and go
into consecutive files; a new file starts when the next tensor's data (padded to 32 bytes)
would take the current file's tensor data past the limit (metadata is not counted). The
first file holds all the metadata; every file holds `split.no` (u16, from 0),
`split.count` (u16) and `split.tensors.count` (i32, tensors in the whole set). Unlike
llama-gguf-split, a tensor larger than the limit gets a file of its own instead of an
error. Tensor bytes are copied as they are (no re-encoding).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import gguf

from pipeline.core.errors import InputError
from pipeline.formats.gguf.reader import GGUFFile, GGUFTensor
from pipeline.formats.gguf.writer import TensorToWrite, Typed, write_gguf

__all__ = ["parse_size", "plan_splits", "split_gguf", "split_name", "SPLIT_NO", "SPLIT_COUNT",
           "SPLIT_TENSORS_COUNT"]

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
_PAD_BYTES = 32  # GGUF_DEFAULT_ALIGNMENT, what llama-gguf-split pads each tensor to when it counts
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
# Decimal units, as llama-gguf-split reads "500M" / "2G".
_UNIT = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """Bytes in "2G", "500M", "300K" or "123456" (decimal units, as llama-gguf-split); else InputError."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise InputError(f"split size {text!r} is not a positive size like 2G, 500M, 300K or 123456")
    return int(float(match.group(1)) * _UNIT[match.group(2).upper()])


def split_name(stem: str, index: int, count: int) -> str:
    """`<stem>-0000i-of-0000N.gguf` for the 0-based `index` (llama.cpp's `llama_split_path`)."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}.gguf"


def plan_splits(tensors: Sequence[GGUFTensor], max_bytes: int) -> list[list[GGUFTensor]]:
    """Consecutive groups of tensors whose padded data fits `max_bytes` (a bigger tensor goes alone)."""
    groups: list[list[GGUFTensor]] = [[]]
    current = 0
    for tensor in tensors:
        padded = -(-tensor.n_bytes // _PAD_BYTES) * _PAD_BYTES
        if groups[-1] and current + padded > max_bytes:
            groups.append([])
            current = 0
        groups[-1].append(tensor)
        current += padded
    return groups


def split_gguf(source: Path, dest_dir: Path, stem: str, max_bytes: int) -> list[Path]:
    """Write `source` as a split set in `dest_dir`; returns the files in order (the first loads the set).

    Raises InputError when the file is itself a split or would need more than 99,999 files,
    or when a destination file exists.
    """
    reader = GGUFFile(source)
    if reader.get_field(SPLIT_COUNT) is not None:
        raise InputError(f"{source} is already one file of a split set; publish the whole model")
    groups = plan_splits(reader.tensors, max_bytes)
    if len(groups) > 99_999:
        raise InputError(f"{len(groups)} files of at most {max_bytes} bytes: raise --split-max-size")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise InputError(f"{source} has no general.architecture; it is not a model file")
    arch = str(arch_field.contents())
    metadata = {key: item.typed() for key, item in reader.fields.items()
                if key != gguf.Keys.General.ARCHITECTURE}
    written = []
    for index, group in enumerate(groups):
        keys = {
            SPLIT_NO: Typed(index, gguf.GGUFValueType.UINT16),
            SPLIT_COUNT: Typed(len(groups), gguf.GGUFValueType.UINT16),
            SPLIT_TENSORS_COUNT: Typed(len(reader.tensors), gguf.GGUFValueType.INT32),
        }
        dest = Path(dest_dir) / split_name(stem, index, len(groups))
        tensors = [_copy_of(source, t) for t in group]
        write_gguf(dest, arch, {**(metadata if index == 0 else {}), **keys}, tensors)
        written.append(dest)
    return written


def _copy_of(source: Path, tensor: GGUFTensor) -> TensorToWrite:
    # Torch order (slowest dimension first) for the writer; the bytes are copied from the file.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return TensorToWrite(tensor.name, tensor.tensor_type, shape, lambda: tensor.data,
                         file_range=(source, tensor.data_offset))
