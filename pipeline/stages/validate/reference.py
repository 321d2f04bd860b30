"""The source model as a GGUF llama.cpp can run, to compare a conversion with.

For a GGUF source the source file itself is the reference. For a Hugging Face checkpoint,
`build_reference` writes one: the source's weights, in the layout llama.cpp expects (the
same `source.iter_tensors` decompose reads), at 16 bits (BF16 sources stay BF16, exactly;
others become F16; 1-D tensors F32), under the *converted* file's own metadata, so the
two files differ in their weights and nothing else: same architecture keys, same
vocabulary, same tokenizer. Tensors the packager computed rather than read (Llama 3.1
rope factors) are copied from the converted file.

Example::

    path = build_reference(card, {"model.safetensors": shard_path}, converted_gguf, workdir / "ref.gguf")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pipeline.core.errors import IntegrityError
from pipeline.formats.gguf.keys import Bonsai, General
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.writer import TensorToWrite, write_gguf
from pipeline.formats.model_card import ModelCard

__all__ = ["build_reference", "REFERENCE_KEY"]

REFERENCE_KEY = "bonsai.reference"  # true in a reference file: never mistaken for an artifact
_QT = gguf.GGMLQuantizationType
_DROPPED = frozenset({General.ARCHITECTURE, General.FILE_TYPE, General.ALIGNMENT, Bonsai.RECIPE})


def _reference_type(shape: tuple[int, ...], source_dtype: str) -> gguf.GGMLQuantizationType:
    if len(shape) <= 1:
        return _QT.F32
    return _QT.BF16 if source_dtype == "BF16" else _QT.F16


def _encode(values: np.ndarray[Any, Any], qtype: gguf.GGMLQuantizationType) -> np.ndarray[Any, Any]:
    if qtype is _QT.F32:
        return np.ascontiguousarray(values, dtype=np.float32)
    if qtype is _QT.F16:
        return np.ascontiguousarray(values, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


class _Streams:
    """Hands out each shard's tensors in plan order, to loaders called in that same order."""

    def __init__(self, card: ModelCard, files: Mapping[str, Path]) -> None:
        self._card, self._files = card, files
        self._open: dict[str, Iterator[tuple[str, Any]]] = {}

    def loader(self, shard: str, name: str, qtype: gguf.GGMLQuantizationType) -> Callable[[], Any]:
        def load() -> Any:
            from pipeline.formats.hf.checkpoint import iter_tensors

            stream = self._open.setdefault(shard, iter_tensors(self._card, self._files, shard))
            got, tensor = next(stream)
            if got != name:
                raise IntegrityError(f"reference: expected {name} next from {shard}, the source gave {got}")
            return _encode(tensor.numpy(), qtype)

        return load


def _copy_of(data: np.ndarray[Any, Any]) -> Callable[[], np.ndarray[Any, Any]]:
    return lambda: np.asarray(data)


def build_reference(card: ModelCard, files: Mapping[str, Path], converted: Path, dest: Path) -> Path:
    """Write the 16-bit reference GGUF of an HF source at `dest`; returns `dest`.

    Raises InputError / IntegrityError from the tensor plan and the source shards (the same
    refusals as decompose), IntegrityError when the converted file has tensors the plan lacks
    that are not computed ones.
    """
    from pipeline.formats.hf.architectures import GENERATED_TENSORS
    from pipeline.formats.hf.checkpoint import tensor_plan

    plan = tensor_plan(card)
    target = GGUFFile(converted)
    meta: dict[str, Any] = {k: f.typed() for k, f in target.fields.items() if k not in _DROPPED}
    meta[General.FILE_TYPE] = int(gguf.LlamaFileType.MOSTLY_F16)
    meta[REFERENCE_KEY] = True
    streams = _Streams(card, files)
    tensors: list[TensorToWrite] = []
    for shard in card.shards:
        for item in (p for p in plan if p.shard == shard):
            qtype = _reference_type(item.shape, item.source_dtype)
            tensors.append(
                TensorToWrite(item.gguf_name, qtype, item.shape, streams.loader(shard, item.gguf_name, qtype))
            )
    planned = {p.gguf_name for p in plan}
    for tensor in target.tensors:
        if tensor.name in planned:
            continue
        if tensor.name not in GENERATED_TENSORS:
            raise IntegrityError(
                f"{converted.name}: tensor {tensor.name!r} is not in the source's tensor plan"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        tensors.append(TensorToWrite(tensor.name, tensor.tensor_type, shape, _copy_of(tensor.data)))
    arch = target.get_field(General.ARCHITECTURE)
    write_gguf(dest, str(arch.contents()) if arch else "llama", meta, tensors)
    return dest
