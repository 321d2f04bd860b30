"""Package stage, HF half: decompose's parts + config.json + tokenizer -> ``model.gguf``.

Architecture keys come from config.json through the architecture table, the vocabulary from
tokenizer.model (SentencePiece) or tokenizer.json (byte-level BPE), and tensors computed from
config (Llama 3.1+ rope factors) are added. The written file is reopened: structure, types
and shapes, and every tensor's bytes compared with its part.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from pipeline.formats.gguf.keys import General
from pipeline.formats.gguf.readback import inspect_gguf
from pipeline.formats.gguf.types import file_type_name, ggml_type
from pipeline.formats.gguf.writer import (
    TensorToWrite,
    file_type_for,
    llama3_rope_factors,
    llama_metadata,
    write_gguf,
)
from pipeline.formats.hf.architectures import ROPE_FREQS
from pipeline.formats.hf.checkpoint import arch_spec
from pipeline.formats.jsonfile import load_json
from pipeline.formats.model_card import ModelCard
from pipeline.formats.tokenizer import load_tokenizer
from pipeline.stages.base import InputFile, OutputFile, StageResult
from pipeline.stages.gguf_build.common import (
    GGML_QUANT_VERSION,
    OUTPUT_NAME,
    Params,
    provenance_keys,
    require,
)
from pipeline.stages.gguf_build.parts import PartTensor, verify_bytes

__all__ = ["package_hf_source"]

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")


def _metadata(params: Params, config: Mapping[str, Any], vocab_meta: Mapping[str, Any], types: set[str],
              card_sha256: str, arch: str, extra_keys: Mapping[str, Any]) -> dict[str, Any]:
    file_type = file_type_for(ggml_type(t) for t in types)
    meta: dict[str, Any] = {General.NAME: params.model_name}
    meta.update(llama_metadata(config, file_type, arch))
    meta[General.QUANTIZATION_VERSION] = GGML_QUANT_VERSION
    meta.update(vocab_meta)
    meta.update(extra_keys)
    meta.update(provenance_keys(params, card_sha256))
    return meta


def _generated_tensors(config: Mapping[str, Any]) -> list[TensorToWrite]:
    """Tensors computed from config.json rather than weights (Llama 3.1+ rope factors)."""
    factors = llama3_rope_factors(config)
    if factors is None:
        return []
    return [TensorToWrite(ROPE_FREQS, gguf.GGMLQuantizationType.F32, tuple(factors.shape), lambda: factors)]


def package_hf_source(
    params: Params,
    download: Mapping[str, InputFile],
    card: ModelCard,
    card_file: InputFile | None,
    ordered: list[PartTensor],
    workdir: Path,
    extra_keys: Mapping[str, Any] | None = None,
) -> StageResult:
    """Write and verify ``model.gguf`` for an HF checkpoint; InputError / IntegrityError name the culprit."""
    config = load_json(require(download, "config.json", "download"), "config.json")
    # tokenizer.model (SentencePiece) wins over tokenizer.json, as in llama.cpp's converter.
    vocab = load_tokenizer({n: download[n].path for n in _TOKENIZER_FILES if n in download}, config)
    types = {t.ggml_type for t in ordered}
    arch = arch_spec(card).gguf_name
    meta = _metadata(params, config, vocab.metadata(), types, card_file.sha256 if card_file else "", arch,
                     extra_keys or {})
    to_write = [
        TensorToWrite(t.gguf_name, ggml_type(t.ggml_type), t.shape, t.loader(), t.file_range)
        for t in ordered
    ]
    to_write += _generated_tensors(config)
    dest = workdir / OUTPUT_NAME
    # Not flushed here: the store flushes what it keeps (a work folder dies with its attempt).
    written = write_gguf(dest, arch, meta, to_write, durable=False)
    summary = inspect_gguf(dest, {t.name: (t.ggml_type, t.shape) for t in to_write})
    verify_bytes(dest, ordered)
    log.info("package: wrote %s (%d bytes, %d tensors, %.3f bpw)", dest.name, written.size_bytes,
             summary.tensor_count, summary.bits_per_weight)
    metrics = {
        "size_bytes": summary.size_bytes,
        "tensor_count": summary.tensor_count,
        "types": dict(summary.types),
        "n_params": summary.n_params,
        "bits_per_weight": round(summary.bits_per_weight, 4),
        "file_type": file_type_name(meta[General.FILE_TYPE]),
        "tokenizer_model": vocab.model,
        "tokenizer_pre": vocab.pre,
    }
    return StageResult(outputs=(OutputFile(OUTPUT_NAME, dest, "gguf", "application/octet-stream"),),
                       metrics=metrics)
