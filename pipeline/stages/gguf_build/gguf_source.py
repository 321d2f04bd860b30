"""Package stage, GGUF-source half: decompose's parts + the source file's own metadata -> ``model.gguf``.

Part of the package stage (`package.run` calls it when the model card's format is "gguf").
The source file already holds everything llama.cpp needs besides the weights: architecture
keys, tokenizer arrays, chat template. They are copied as they are, so any architecture
llama.cpp knows (gemma3 included) is repackaged without a per-architecture table. Only
what must change is written anew: ``general.file_type`` (from the new tensor types),
``general.quantization_version``, alignment (the writer's), and the ``bonsai.*`` provenance.
After writing, the file is reopened: structure, types, shapes, every tensor's bytes, and
every copied metadata value are compared with what was meant.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.gguf.keys import General
from pipeline.formats.gguf.readback import inspect_gguf
from pipeline.formats.gguf.tensor_source import source_metadata
from pipeline.formats.gguf.types import file_type_name, ggml_type
from pipeline.formats.gguf.writer import TensorToWrite, file_type_for, write_gguf
from pipeline.formats.model_card import ModelCard
from pipeline.stages.base import InputFile, OutputFile, StageResult
from pipeline.stages.gguf_build.common import (
    GGML_QUANT_VERSION,
    OUTPUT_NAME,
    Params,
    provenance_keys,
    require,
)
from pipeline.stages.gguf_build.parts import PartTensor, verify_bytes

__all__ = ["package_gguf_source"]

log = logging.getLogger(__name__)


def _metadata(params: Params, copied: Mapping[str, Any], types: set[str], card_sha256: str,
              extra_keys: Mapping[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = dict(copied)
    # The source's own name ("Gemma 3 270m") says more than a file name; keep it when present.
    meta.setdefault(General.NAME, params.model_name)
    meta[General.FILE_TYPE] = int(file_type_for(ggml_type(t) for t in types))
    meta[General.QUANTIZATION_VERSION] = GGML_QUANT_VERSION
    meta.update(extra_keys)
    meta.update(provenance_keys(params, card_sha256))
    return meta


def _verify_metadata(path: Path, copied: Mapping[str, Any]) -> None:
    """Every copied key must read back with the source's type and value."""
    written, _ = source_metadata(path)
    for key, value in copied.items():
        if written.get(key) != value:
            raise IntegrityError(f"{path.name}: metadata {key!r} reads back differently from the source file")


def package_gguf_source(
    params: Params,
    download: Mapping[str, InputFile],
    card: ModelCard,
    card_file: InputFile | None,
    ordered: list[PartTensor],
    workdir: Path,
    extra_keys: Mapping[str, Any] | None = None,
) -> StageResult:
    """Write and verify ``model.gguf`` from a GGUF source's metadata and the matched parts.

    Raises InputError when the source file is not among the inputs, IntegrityError when the
    written file does not read back as meant.
    """
    shards = list(card.shards)
    if len(shards) != 1:
        raise InputError(f"a GGUF model card names exactly one source file; this one names {shards}")
    source_path = require(download, str(shards[0]), "download")
    copied, dropped = source_metadata(source_path)
    types = {t.ggml_type for t in ordered}
    meta = _metadata(params, copied, types, card_file.sha256 if card_file else "", extra_keys or {})
    to_write = [
        TensorToWrite(t.gguf_name, ggml_type(t.ggml_type), t.shape, t.loader())
        for t in ordered
    ]
    dest = workdir / OUTPUT_NAME
    # Not flushed here: the store flushes what it keeps (a work folder dies with its attempt).
    written = write_gguf(dest, card.architecture, meta, to_write, durable=False)
    summary = inspect_gguf(dest, {t.name: (t.ggml_type, t.shape) for t in to_write})
    verify_bytes(dest, ordered)
    _verify_metadata(dest, copied)
    log.info(
        "package: wrote %s from GGUF source %s (%d bytes, %d tensors, %.3f bpw, %d keys copied)",
        dest.name,
        shards[0],
        written.size_bytes,
        summary.tensor_count,
        summary.bits_per_weight,
        len(copied),
    )
    source_types = Counter({str(k): int(v) for k, v in card.dtypes.items()})
    metrics = {
        "size_bytes": summary.size_bytes,
        "tensor_count": summary.tensor_count,
        "types": dict(summary.types),
        "n_params": summary.n_params,
        "bits_per_weight": round(summary.bits_per_weight, 4),
        "file_type": file_type_name(meta[General.FILE_TYPE]),
        "source_format": "gguf",
        "source_types": dict(sorted(source_types.items())),
        "source_file_type": card.file_type,
        "architecture": card.architecture,
        "metadata_keys_copied": len(copied),
    }
    return StageResult(
        outputs=(OutputFile(OUTPUT_NAME, dest, "gguf", "application/octet-stream"),),
        metrics=metrics,
        warnings=tuple(dropped),
    )
