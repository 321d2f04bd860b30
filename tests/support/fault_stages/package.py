"""The real package stage."""

from pipeline.stages.package import NAME, VERSION, Params, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run"]
