"""The real calibrate stage."""

from pipeline.stages.calibrate import NAME, VERSION, Params, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run"]
