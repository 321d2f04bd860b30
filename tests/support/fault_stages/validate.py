"""The real validate stage."""

from pipeline.stages.validate import NAME, VERSION, Params, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run"]
