"""Demo checkpoints (tiny, ternary-trained-style) for the README's demo and the tests."""

from __future__ import annotations

from pipeline.demo.checkpoint import DEMO_FILES, write_demo_checkpoint

__all__ = ["DEMO_FILES", "write_demo_checkpoint"]
