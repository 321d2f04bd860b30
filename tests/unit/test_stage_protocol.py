"""Every stage package the runtime can be pointed at (`stage_package`) provides the whole Stage protocol.

mypy checks the real stages statically; the benchmarks' and the tests' stand-ins are modules
loaded by name, so their hooks are checked here, where a missing one would fail a job at run time.
"""

from __future__ import annotations

import importlib

import pytest

from pipeline.core.states import STAGE_ORDER

_PROTOCOL = ("NAME", "VERSION", "FANOUT", "make_params", "select_inputs", "cache_identity", "memory_need",
             "run")


@pytest.mark.parametrize(
    "package", ["pipeline.stages", "bench.noop_stages", "bench.scaling_stages", "tests.support.fault_stages"]
)
def test_every_stage_module_has_every_hook(package: str) -> None:
    for stage in STAGE_ORDER:
        module = importlib.import_module(f"{package}.{stage.value}")
        missing = [name for name in _PROTOCOL if not hasattr(module, name)]
        assert not missing, f"{package}.{stage.value} lacks {missing}"
        assert module.NAME == stage.value
        assert module.FANOUT is None or callable(module.FANOUT.join)
