"""Stage 4, calibrate: run the source once; its answers, and the activation statistics recipes ask for."""

from __future__ import annotations

from pipeline.stages.calibrate.stage import NAME, VERSION, Params, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run"]
