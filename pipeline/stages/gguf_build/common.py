"""What both halves of the GGUF writer share: the package parameters, output name and provenance keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from pipeline import __version__
from pipeline.core.errors import InputError
from pipeline.core.option_fields import option
from pipeline.formats.decompose_report import ImatrixUse
from pipeline.formats.gguf.keys import Bonsai, QuantizeImatrix
from pipeline.formats.gguf.writer import Typed
from pipeline.stages.base import InputFile

__all__ = ["Params", "OUTPUT_NAME", "GGML_QUANT_VERSION", "provenance_keys", "imatrix_keys", "require"]

OUTPUT_NAME = "model.gguf"
GGML_QUANT_VERSION = 2  # gguf-py's GGML_QUANT_VERSION; llama.cpp checks it for block types


@dataclass(frozen=True)
class Params:
    """`model_name` becomes general.name; `source` and `recipe` are recorded as provenance keys."""

    model_name: str = option(key="name", shown_default=None,
                             help="model name in the GGUF and in its file name (default: from the source)")
    source: str = ""
    recipe: str = ""


def provenance_keys(params: Params, card_sha256: str) -> dict[str, Any]:
    """The bonsai.* keys every packaged file carries: where it came from and what made it."""
    return {
        Bonsai.SOURCE: params.source,
        Bonsai.RECIPE: params.recipe,
        Bonsai.VERSION: __version__,
        Bonsai.SOURCE_CARD_SHA256: card_sha256,
    }


def imatrix_keys(use: ImatrixUse | None) -> dict[str, Any]:
    """The quantize.imatrix.* keys llama-quantize writes when an imatrix weighted the quants: strings
    cut at 127 bytes and counts as UINT32, as it writes them; the dataset only when the imatrix names
    one, the chunk count only when it is known. Nothing without an imatrix."""
    if use is None:
        return {}
    keys: dict[str, Any] = {QuantizeImatrix.FILE: _cut(use.file)}
    if use.dataset:
        keys[QuantizeImatrix.DATASET] = _cut(use.dataset)
    keys[QuantizeImatrix.ENTRIES_COUNT] = Typed(int(use.entries_count), gguf.GGUFValueType.UINT32)
    if use.chunks_count > 0:
        keys[QuantizeImatrix.CHUNKS_COUNT] = Typed(int(use.chunks_count), gguf.GGUFValueType.UINT32)
    return keys


def _cut(text: str) -> str:
    # llama.cpp's key overrides hold 128 bytes with the terminator; never split a UTF-8 character.
    return text.encode("utf-8")[:127].decode("utf-8", errors="ignore")


def require(files: Mapping[str, InputFile], name: str, stage: str) -> Path:
    """The local path of input `stage/name`; InputError naming what was given instead."""
    if name not in files:
        raise InputError(f"package needs input {stage}/{name}; got {sorted(files)}")
    return files[name].path
