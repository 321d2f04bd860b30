"""Source side for a GGUF checkpoint: its tensor plan, its tensors as float32, its metadata.

The HF counterpart is `source.py`. A GGUF source already carries GGUF tensor names and
llama.cpp's layout (q/k rows permuted, norms as llama.cpp wants them), so nothing is
renamed or permuted here: each tensor is only dequantized (any type `gguf.quants` can
dequantize: F32, F16, BF16, Q8_0, Q4_K, Q6_K, ...) to float32, one at a time, from the
memory-mapped file (`reader.GGUFFile`).

It reads the `ModelCard` the inspect stage writes for a ``.gguf`` file (format "gguf", one
shard, shapes in torch order ``[rows, cols]``: ggml's dimensions reversed).

Example::

    plan = tensor_plan(card)
    for gguf_name, weight in iter_tensors(card, {"model.gguf": path}, "model.gguf"):
        ...
    metadata, dropped = source_metadata(path)   # key -> Typed, to copy into the repackaged file
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.gguf.keys import Bonsai, General, QuantizeImatrix
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.types import BONSAI_TYPES
from pipeline.formats.gguf.writer import Typed
from pipeline.formats.model_card import ModelCard
from pipeline.formats.plan import PlannedTensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "GGUF_FORMAT",
    "REWRITTEN_KEYS",
    "dequantizable_types",
    "is_gguf_card",
    "open_reader",
    "tensor_plan",
    "iter_tensors",
    "source_metadata",
    "dequantize_tensor",
]

GGUF_FORMAT = "gguf"  # card["format"] of a GGUF source
# Keys the packager writes itself: the writer adds general.architecture, the tensor types
# decide file_type, alignment follows the writer's layout, and bonsai.* is our provenance.
REWRITTEN_KEYS: frozenset[str] = frozenset(
    {General.ARCHITECTURE, General.FILE_TYPE, General.ALIGNMENT, General.QUANTIZATION_VERSION}
)
# bonsai.* (Bonsai.SOURCE and friends) is rewritten; GGUF.* are the reader's pseudo-fields (counts).
# quantize.imatrix.* told how the source was quantized: the written file says how it was, or nothing.
_REWRITTEN_PREFIXES = (Bonsai.SOURCE.split(".", 1)[0] + ".", "GGUF.", QuantizeImatrix.PREFIX)


@lru_cache(maxsize=1)
def dequantizable_types() -> frozenset[str]:
    """Names of the ggml types `gguf.quants.dequantize` turns into float32 in this gguf version.

    Found by asking it, one zero block each, so a newer gguf widens the set by itself.
    """
    names = set()
    for qtype in gguf.GGMLQuantizationType:
        if qtype not in gguf.GGML_QUANT_SIZES:
            continue
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            names.add(qtype.name)
            continue
        if block_size == 1 and qtype is not gguf.GGMLQuantizationType.BF16:
            continue  # integer and F64 storage: not weights we re-quantize
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, KeyError):
            continue
        names.add(qtype.name)
    return frozenset(names)


def source_types() -> frozenset[str]:
    """Types a GGUF source may hold: what gguf can dequantize, plus the Bonsai block types
    (Q2_0, Q1_0: decoded by the decoder the caller passes to `iter_tensors`)."""
    return dequantizable_types() | frozenset(BONSAI_TYPES)


def is_gguf_card(card: ModelCard) -> bool:
    """Whether a model card describes a single-file GGUF source."""
    return card.format == GGUF_FORMAT


def tensor_plan(card: ModelCard) -> list[PlannedTensor]:
    """Every tensor of a GGUF card, in file order, with its GGUF name (= its own name); reads no data.

    Raises InputError when the card is not a GGUF card, names a type we cannot dequantize,
    repeats a tensor, or puts a tensor in a shard it does not list.
    """
    if not is_gguf_card(card):
        raise InputError(f"model card format is {card.format!r}, not {GGUF_FORMAT!r}")
    shards = set(card.shards)
    supported = source_types()
    planned: list[PlannedTensor] = []
    seen: set[str] = set()
    for entry in card.tensors:
        name, dtype, shard, shape = entry.name, entry.dtype, entry.shard, entry.shape
        if name in seen:
            raise InputError(f"model card lists tensor {name!r} twice")
        if shard not in shards:
            raise InputError(f"tensor {name!r} lives in {shard!r}, which the card's shards omit")
        if dtype not in supported:
            raise InputError(
                f"tensor {name!r} is {dtype}, which gguf cannot dequantize "
                f"(supported: {', '.join(sorted(supported))})"
            )
        seen.add(name)
        planned.append(PlannedTensor(name, name, tuple(shape), dtype, shard))
    if not planned:
        raise InputError("the GGUF model card lists no tensors")
    return planned


def open_reader(path: Path) -> GGUFFile:
    """The file parsed and memory-mapped (`reader.GGUFFile`); IntegrityError when it is not sound GGUF."""
    return GGUFFile(path)


Decoder = Callable[[np.ndarray[Any, Any], str], np.ndarray[Any, Any]]


def dequantize_tensor(tensor: Any, decoder: Decoder | None = None) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A reader tensor's values as a writable float32 array in torch order ([rows, cols]).

    `decoder(raw_bytes, type_name)` decodes the types gguf has no maths for (Q2_0, Q1_0).
    """
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type.name in BONSAI_TYPES:
        if decoder is None:
            raise InputError(f"tensor {tensor.name!r}: {tensor.tensor_type.name} needs a decoder here")
        values = decoder(np.asarray(tensor.data).reshape(-1), tensor.tensor_type.name).reshape(shape)
        return np.array(values, dtype=np.float32, order="C")
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    try:
        values = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
    except NotImplementedError as exc:
        raise InputError(f"tensor {tensor.name!r}: gguf cannot dequantize {qtype.name}") from exc
    values = values.reshape(shape)
    # F32 comes back as a read-only view of the mapped file; torch wants memory it may own.
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")
    return values


def iter_tensors(
    card: ModelCard, files: Mapping[str, Path], shard: str, decoder: Decoder | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (gguf_name, float32 contiguous tensor) for every planned tensor of the GGUF file `shard`.

    One tensor is dequantized at a time from the memory-mapped file, so peak memory is about
    one float32 tensor. Raises InputError when the file is missing, IntegrityError when the
    file's tensors disagree with the card (absent, other type or shape).
    """
    import torch

    planned = [p for p in tensor_plan(card) if p.shard == shard]
    if not planned:
        raise InputError(f"shard {shard!r} holds no planned tensors; card shards: {list(card.shards)}")
    path = files.get(shard)
    if path is None or not Path(path).is_file():
        raise InputError(f"GGUF source {shard!r} is not among the input files ({sorted(files)})")
    reader = open_reader(Path(path))
    by_name = {t.name: t for t in reader.tensors}
    for item in planned:
        tensor = by_name.get(item.gguf_name)
        if tensor is None:
            raise IntegrityError(f"tensor {item.gguf_name!r} is in the model card but not in {shard!r}")
        type_name = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if type_name != item.source_dtype or shape != item.shape:
            raise IntegrityError(
                f"tensor {item.gguf_name!r} in {shard!r} is {type_name} {list(shape)}; "
                f"the model card says {item.source_dtype} {list(item.shape)}"
            )
        yield item.gguf_name, torch.from_numpy(dequantize_tensor(tensor, decoder))
        del tensor


def source_metadata(path: Path) -> tuple[dict[str, Typed], list[str]]:
    """The source file's metadata to copy as-is (every key but `REWRITTEN_KEYS`, bonsai.* and
    quantize.imatrix.*).

    Returns (key -> Typed in file order, reasons for keys that cannot be copied: empty arrays,
    which gguf's writer cannot produce). Nested arrays are refused by the reader.
    """
    reader = open_reader(Path(path))
    copied: dict[str, Typed] = {}
    dropped: list[str] = []
    for key, field in reader.fields.items():
        if key in REWRITTEN_KEYS or key.startswith(_REWRITTEN_PREFIXES):
            continue
        if field.types[0] is gguf.GGUFValueType.ARRAY and not field.data:
            dropped.append(f"metadata key {key!r}: empty array; gguf's writer cannot write one")
            continue
        # Typed keeps strings as bytes: token lists may hold bytes that are not valid UTF-8.
        copied[key] = field.typed()
    return copied, dropped
