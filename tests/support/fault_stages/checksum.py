"""The real checksum stage."""

from pipeline.stages.checksum import NAME, VERSION, Params, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run"]
