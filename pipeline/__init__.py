"""Bonsai Pipeline: model checkpoints to ternary GGUF files, recorded and auditable."""

from __future__ import annotations

__version__ = "0.1.0"
