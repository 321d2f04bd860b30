"""Stage 3, inspect: validate the checkpoint's structure before any heavy work and write its card."""

from __future__ import annotations

from pipeline.stages.inspect.stage import (
    CARD_NAME,
    NAME,
    SUPPORTED_ARCHITECTURES,
    VERSION,
    Params,
    make_params,
    run,
)

__all__ = [
    "NAME",
    "VERSION",
    "CARD_NAME",
    "SUPPORTED_ARCHITECTURES",
    "Params",
    "make_params",
    "run",
]
