"""The real inspect stage."""

from pipeline.stages.inspect import NAME, VERSION, Params, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run"]
