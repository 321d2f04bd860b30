"""Stage 6, package: decompose's parts + metadata + tokenizer -> one verified llama.cpp GGUF file."""

from __future__ import annotations

from pipeline.stages.package.stage import (
    NAME,
    VERSION,
    Params,
    PartTensor,
    make_params,
    run,
)

__all__ = [
    "NAME",
    "VERSION",
    "Params",
    "make_params",
    "run",
    "PartTensor",
]
