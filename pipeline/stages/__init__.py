"""The stages, each a module that is a `base.Stage`: NAME, VERSION, make_params(),
select_inputs(), cache_identity() and run().

``select_inputs(params, inputs)`` is the subset of its upstream outputs a stage reads for these
params (decompose reads calibrate's files only when its recipe asks); the cache key and the
recorded input links cover exactly that subset.

Modules are imported on first use: torch and llama.cpp load only where a stage needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from pipeline.core.states import STAGE_INPUTS, StageName
from pipeline.stages.base import Stage

__all__ = ["load_stage", "UPSTREAM"]

# Which earlier stages' outputs each stage reads: the one graph, declared in core (orchestration reads
# it without importing any stage).
UPSTREAM = STAGE_INPUTS


def load_stage(stage: StageName, package: str = "pipeline.stages") -> Stage:
    """The module implementing `stage`; `package` lets benchmarks swap in no-op stages."""
    module: Any = importlib.import_module(f"{package}.{stage.value}")
    return cast("Stage", module)


if TYPE_CHECKING:
    # mypy checks every stage module against the Stage protocol here.
    from pipeline.stages import (
        calibrate,
        checksum,
        decompose,
        download,
        inspect,
        package,
        sensitivity,
        validate,
    )
    STAGE_MODULES: tuple[Stage, ...] = (
        download, checksum, inspect, calibrate, sensitivity, decompose, package, validate,
    )
