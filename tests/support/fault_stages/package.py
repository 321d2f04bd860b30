"""The real package stage, after the delay ``BONSAI_TEST_PACKAGE_FAULT=delay:S`` asks for (so a test
can see what runs beside it)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from pipeline.stages.base import NO_CLIENTS, InputFile, StageClients, StageResult
from pipeline.stages.package import *  # noqa: F403 - the real stage's hooks; only run is wrapped
from pipeline.stages.package import Params, __all__  # noqa: F401
from pipeline.stages.package import run as real_run


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    fault = os.environ.get("BONSAI_TEST_PACKAGE_FAULT", "")
    if fault.startswith("delay:"):
        time.sleep(float(fault.split(":", 1)[1]))
    return real_run(params, inputs, workdir, clients)
