"""The seven stages, each a module with NAME, VERSION, Params, make_params() and run().

A stage module may also define ``select_inputs(params, inputs)``: the subset of its upstream
outputs it reads for these params (decompose reads calibrate's files only when its recipe asks);
the cache key and the recorded input links cover exactly that subset.

Modules are imported on first use: torch and llama.cpp load only where a stage needs them.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from pipeline.core.states import STAGE_INPUTS, StageName

__all__ = ["load_stage", "UPSTREAM"]

# Which earlier stages' outputs each stage reads: the one graph, declared in core (orchestration reads
# it without importing any stage).
UPSTREAM = STAGE_INPUTS


def load_stage(stage: StageName, package: str = "pipeline.stages") -> ModuleType:
    """The module implementing `stage`; `package` lets benchmarks swap in no-op stages."""
    return importlib.import_module(f"{package}.{stage.value}")


if TYPE_CHECKING:
    # mypy checks every stage module against the Stage protocol here.
    from pipeline.stages import calibrate, checksum, decompose, download, inspect, package, validate
    from pipeline.stages.base import Stage

    STAGE_MODULES: tuple[Stage, ...] = (download, checksum, inspect, calibrate, decompose, package, validate)
