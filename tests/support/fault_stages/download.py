"""The real download stage."""

from pipeline.stages.download import NAME, VERSION, Params, cache_identity, make_params, run

__all__ = ["NAME", "VERSION", "Params", "make_params", "run", "cache_identity"]
