"""Inspect for a single ``.gguf`` source: its header read by the one bounded GGUF reader -> a model card.

A GGUF source is repackaged with its own metadata, so any architecture llama.cpp knows is
accepted (gguf-py's table mirrors llama.cpp's); every tensor must be a type gguf can dequantize.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.tensor_source import source_types as allowed_source_types
from pipeline.formats.model_card import CardTensor, ModelCard, TokenizerInfo
from pipeline.stages.base import InputFile

__all__ = ["gguf_card"]

_GGUF_CONFIG_MAX_ITEMS = 64  # arrays longer than this (vocabularies) stay out of the card's config
_GGUF_TOKENIZER_KINDS = {"gpt2": "bpe", "llama": "sentencepiece"}


def gguf_card(files: Mapping[str, InputFile], gguf_files: list[str]) -> ModelCard:
    """The card of a single GGUF file source (any architecture llama.cpp knows)."""
    if len(gguf_files) > 1:
        raise InputError(f"{len(gguf_files)} .gguf files ({', '.join(gguf_files[:5])}); give exactly one")
    name = gguf_files[0]
    card = _card_from_file(files[name].path, name)
    # A GGUF source is repackaged with its own metadata, so any architecture llama.cpp knows
    # (gguf-py's table mirrors llama.cpp's) is accepted; HF checkpoints need a row per architecture.
    known = sorted(gguf.MODEL_ARCH_NAMES.values())
    if card.architecture not in known:
        raise InputError(
            f"{name}: GGUF architecture {card.architecture!r} is not one llama.cpp knows "
            f"({len(known)} known, e.g. {', '.join(known[:8])}); update the gguf package if it is new"
        )
    return card


def _card_from_file(path: Path, name: str) -> ModelCard:
    """A model card for a single GGUF file: architecture, metadata, tensor list, tokenizer kind."""
    file_size = path.stat().st_size
    if file_size < 24:
        raise InputError(f"{name}: {file_size} bytes is too short for a GGUF file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise InputError(f"{name}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    source_types = allowed_source_types()
    # The one bounded reader: every count and length is checked against the file size first.
    reader = GGUFFile(path, label=name)
    try:
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and len(field.data) <= _GGUF_CONFIG_MAX_ITEMS
        }
    except IntegrityError as exc:
        raise IntegrityError(f"{name}: {exc}") from exc
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise InputError(f"{name}: GGUF metadata has no general.architecture string")
    tensors: list[CardTensor] = []
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise IntegrityError(
                f"{name}: tensor {tensor.name!r} ends at byte {tensor.data_offset + tensor.n_bytes} "
                f"but the file has {file_size} bytes (truncated?)"
            )
        # Any type gguf can dequantize is a source (re-quantizing a Q4_K file is the user's call);
        # integer or F64 storage is not a weight we can decompose.
        if type_name not in source_types:
            raise InputError(
                f"{name}: tensor {tensor.name!r} is {type_name}, which gguf cannot dequantize; a GGUF "
                f"source must hold {', '.join(sorted(source_types))} tensors"
            )
        # ggml lists dimensions fastest-first; reversed gives the row-major shape HF cards use.
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        tensors.append(CardTensor(tensor.name, tuple(shape), type_name, name))
    return ModelCard(
        architecture=architecture,
        hf_architecture=None,
        config=metadata,
        format="gguf",
        shards=(name,),
        tensors=tuple(tensors),
        param_count=sum(int(t.n_elements) for t in reader.tensors),
        # The source type histogram: a Q4_K_M file holds Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors.
        dtypes=dict(sorted(Counter(t.dtype for t in tensors).items())),
        file_type=_gguf_file_type(metadata.get("general.file_type")),
        tokenizer=TokenizerInfo(
            _GGUF_TOKENIZER_KINDS.get(str(metadata.get("tokenizer.ggml.model"))),
            (name,) if "tokenizer.ggml.model" in metadata else (),
        ),
    )


def _gguf_file_type(value: Any) -> str | None:
    """general.file_type as llama.cpp's name (MOSTLY_Q4_K_M), or None when absent or unknown."""
    try:
        return gguf.LlamaFileType(int(value)).name if value is not None else None
    except (ValueError, TypeError):
        return None
