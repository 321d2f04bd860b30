"""What both halves of the GGUF writer share: the package parameters, output name and provenance keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.core.errors import InputError
from pipeline.core.option_fields import option
from pipeline.formats.gguf.keys import Bonsai
from pipeline.stages.base import InputFile

__all__ = ["Params", "OUTPUT_NAME", "GGML_QUANT_VERSION", "provenance_keys", "require"]

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


def require(files: Mapping[str, InputFile], name: str, stage: str) -> Path:
    """The local path of input `stage/name`; InputError naming what was given instead."""
    if name not in files:
        raise InputError(f"package needs input {stage}/{name}; got {sorted(files)}")
    return files[name].path
