"""The sensitivity stage: the KL each group step of the auto recipe adds, measured once per source
and ladder, for decompose to allocate every budget on (``sensitivity=measured``)."""

from __future__ import annotations

from pipeline.stages.sensitivity.stage import (
    NAME,
    VERSION,
    Params,
    cache_identity,
    make_params,
    memory_need,
    run,
    select_inputs,
)

__all__ = ["NAME", "VERSION", "FANOUT", "Params", "make_params", "memory_need", "cache_identity",
           "select_inputs", "run"]

# Runs whole: every file it scores holds every shard's tensors.
FANOUT = None
