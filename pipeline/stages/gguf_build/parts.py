"""The package stage's side of decompose's part files: read them, match them to the plan, check the copy."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.gguf import tensor_source as gguf_source
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.hf import checkpoint
from pipeline.formats.model_card import ModelCard
from pipeline.formats.parts import PartIndex
from pipeline.formats.rawio import mapped_bytes, pread_exact
from pipeline.stages.base import InputFile
from pipeline.ternary.pack import PART_TYPES, tensor_nbytes

__all__ = ["PART_NAME", "PART_TYPES", "PartTensor", "collect_parts", "match_plan", "verify_bytes"]

PART_NAME = re.compile(r"^ternary/part-\d{5}\.safetensors$")
_VERIFY_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class PartTensor:
    """One tensor found in a decompose part; ``offset``: where its bytes start in the part file."""

    gguf_name: str
    ggml_type: str
    shape: tuple[int, ...]
    part: Path
    offset: int

    def loader(self) -> Callable[[], Any]:
        """A provider of the tensor's raw bytes (used where a file-to-file copy is not possible)."""

        def load() -> Any:
            raw = np.empty(self.n_bytes, np.uint8)
            with open(self.part, "rb") as handle:
                pread_exact(handle.fileno(), raw.data, self.offset)
            return raw

        return load

    @property
    def n_bytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)

    @property
    def file_range(self) -> tuple[Path, int]:
        """Where the bytes sit, for a file-to-file copy (no pass through this process)."""
        return self.part, self.offset


def collect_parts(parts: Mapping[str, InputFile]) -> dict[str, PartTensor]:
    """Every tensor of every part, by GGUF name; IntegrityError when one is in two parts."""
    if not parts:
        raise InputError("package needs decompose/ternary/part-XXXXX.safetensors inputs; got none")
    found: dict[str, PartTensor] = {}
    for part_name in sorted(parts):
        index = PartIndex.load(parts[part_name].path, f"part {part_name}", tensor_nbytes, PART_TYPES)
        for entry in index.entries:
            if entry.gguf_name in found:
                raise IntegrityError(
                    f"tensor {entry.gguf_name!r} is in two parts ({found[entry.gguf_name].part.name}, "
                    f"{part_name})"
                )
            found[entry.gguf_name] = PartTensor(entry.gguf_name, entry.ggml_type, entry.shape,
                                                parts[part_name].path, int(entry.offset or 0))
    return found


def match_plan(card: ModelCard, found: Mapping[str, PartTensor]) -> list[PartTensor]:
    """Parts' tensors in plan order; every planned tensor present with its planned shape."""
    plan = (gguf_source if gguf_source.is_gguf_card(card) else checkpoint).tensor_plan(card)
    planned = {p.gguf_name for p in plan}
    missing = [p.gguf_name for p in plan if p.gguf_name not in found]
    extra = sorted(set(found) - planned)
    if missing or extra:
        raise IntegrityError(
            f"decompose parts do not match the model card: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {extra[:5]} ({len(extra)}); rerun decompose for this model card"
        )
    for p in plan:
        if found[p.gguf_name].shape != p.shape:
            raise IntegrityError(
                f"tensor {p.gguf_name!r} is {list(found[p.gguf_name].shape)} in its part; "
                f"the model card says {list(p.shape)}"
            )
    return [found[p.gguf_name] for p in plan]


def verify_bytes(path: Path, ordered: list[PartTensor]) -> None:
    """Compare every tensor's bytes in the written file with its part, 64 MB at a time through
    mappings of both files (no copies; each window unmapped before the next, so memory stays flat
    whatever the model size)."""
    by_name = {t.name: t for t in GGUFFile(path).tensors}
    with open(path, "rb") as written_file:
        for item in ordered:
            written = by_name[item.gguf_name]
            with open(item.part, "rb") as part_file:
                for done in range(0, written.n_bytes, _VERIFY_CHUNK_BYTES):
                    n = min(_VERIFY_CHUNK_BYTES, written.n_bytes - done)
                    ours = mapped_bytes(written_file.fileno(), written.data_offset + done, n,
                                        f"tensor {item.gguf_name!r} of {path.name}")
                    theirs = mapped_bytes(part_file.fileno(), item.offset + done, n,
                                          f"tensor {item.gguf_name!r} of its part {item.part.name}")
                    if not np.array_equal(ours, theirs):
                        raise IntegrityError(
                            f"{path.name}: bytes of tensor {item.gguf_name!r} differ from its decompose part"
                        )
                    del ours, theirs
