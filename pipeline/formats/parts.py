"""Decompose part files: GGUF-ready tensor bytes inside a plain safetensors file, and their index.

A part is a valid safetensors file in which every tensor is dtype U8, shape ``[n_bytes]``,
holding its bytes already in the GGUF layout of its ggml type, keyed by GGUF name. Its
``__metadata__`` carries the index (the parts manifest)::

    {"bonsai.format": "ternary-part/1",
     "bonsai.tensors": "<JSON: {gguf_name: {\"ggml_type\": \"TQ2_0\", \"shape\": [rows, cols]}}>"}

`PartIndex` is the one contract for it: `header_bytes` writes it (the header is known before
any tensor is fitted, so a part streams), `load` reads it back through the one safetensors
header validator and checks every declared tensor against what the file stores.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.formats.safetensors import read_header

__all__ = ["PART_FORMAT", "FORMAT_KEY", "TENSORS_KEY", "PartEntry", "PartIndex", "part_name"]

PART_FORMAT = "ternary-part/1"
FORMAT_KEY = "bonsai.format"
TENSORS_KEY = "bonsai.tensors"
_FIX = "rerun decompose for this job (`bonsai retry JOB --from decompose --force`)"


def part_name(shard_index: int) -> str:
    """Logical output name of decompose's part for 1-based source shard ``shard_index``."""
    return f"ternary/part-{shard_index:05d}.safetensors"


@dataclass(frozen=True)
class PartEntry:
    """One tensor of a part: GGUF name, ggml type, shape in torch order, byte count and offset.

    ``offset`` is absolute in the part file (None before the file exists).
    """

    gguf_name: str
    ggml_type: str
    shape: tuple[int, ...]
    n_bytes: int
    offset: int | None = None


@dataclass(frozen=True)
class PartIndex:
    """The tensors of one part file, in file order."""

    entries: tuple[PartEntry, ...]

    def header_bytes(self) -> bytes:
        """The safetensors header (length prefix + JSON, space-padded to 8 bytes) declaring the entries."""
        header: dict[str, Any] = {}
        offset = 0
        for entry in self.entries:
            header[entry.gguf_name] = {"dtype": "U8", "shape": [entry.n_bytes],
                                       "data_offsets": [offset, offset + entry.n_bytes]}
            offset += entry.n_bytes
        index = {e.gguf_name: {"ggml_type": e.ggml_type, "shape": list(e.shape)} for e in self.entries}
        header["__metadata__"] = {FORMAT_KEY: PART_FORMAT, TENSORS_KEY: json.dumps(index)}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def by_name(self) -> dict[str, PartEntry]:
        return {entry.gguf_name: entry for entry in self.entries}

    @property
    def file_size_bytes(self) -> int:
        return len(self.header_bytes()) + sum(e.n_bytes for e in self.entries)

    @classmethod
    def load(cls, path: Path, label: str, nbytes_of: Callable[[str, tuple[int, ...]], int],
             allowed_types: Sequence[str]) -> PartIndex:
        """Read a part's index and check it against the stored tensors.

        ``nbytes_of(ggml_type, shape)`` gives the byte count a type needs. Raises IntegrityError
        naming `label` and the tensor when the file is not a part this version writes.
        """
        header = read_header(path, name=label)  # header only: the data is never mapped
        if header.metadata.get(FORMAT_KEY) != PART_FORMAT:
            raise IntegrityError(f"{label}: format {header.metadata.get(FORMAT_KEY)!r}, expected "
                                 f"{PART_FORMAT!r}; {_FIX}")
        declared = _declared(header.metadata.get(TENSORS_KEY), label)
        stored = {t.name: t for t in header.tensors}
        if set(stored) != set(declared):
            raise IntegrityError(
                f"{label}: stored tensors {sorted(set(stored) - set(declared))[:5]} undeclared, "
                f"declared {sorted(set(declared) - set(stored))[:5]} absent; {_FIX}"
            )
        entries = []
        for tensor in header.tensors:  # file order
            ggml_type, shape = declared[tensor.name]
            if ggml_type not in allowed_types:
                raise IntegrityError(f"{label}: tensor {tensor.name!r} has type {ggml_type!r}; allowed "
                                     f"{', '.join(allowed_types)}; {_FIX}")
            try:
                n_bytes = nbytes_of(ggml_type, shape)
            except ValueError as exc:
                raise IntegrityError(f"{label}: tensor {tensor.name!r}: {exc}; {_FIX}") from exc
            if tensor.dtype != "U8" or list(tensor.shape) != [n_bytes]:
                raise IntegrityError(
                    f"{label}: tensor {tensor.name!r} is {tensor.dtype} {list(tensor.shape)}; "
                    f"{ggml_type} {list(shape)} needs U8 [{n_bytes}]; {_FIX}"
                )
            entries.append(PartEntry(tensor.name, ggml_type, shape, n_bytes, tensor.begin))
        return cls(tuple(entries))


def _declared(raw: str | None, label: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    if raw is None:
        raise IntegrityError(f"{label}: no {TENSORS_KEY!r} metadata; {_FIX}")
    try:
        document = json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{label}: {TENSORS_KEY!r} is not JSON ({exc}); {_FIX}") from exc
    if not isinstance(document, dict):
        raise IntegrityError(f"{label}: {TENSORS_KEY!r} is not an object; {_FIX}")
    declared = {}
    for name, info in document.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        ggml_type = info.get("ggml_type") if isinstance(info, dict) else None
        if not isinstance(ggml_type, str) or not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise IntegrityError(f"{label}: index entry of {name!r} is {info!r}; {_FIX}")
        declared[name] = (ggml_type, tuple(shape))
    return declared
