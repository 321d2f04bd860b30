"""The real calibrate stage, or, with ``BONSAI_TEST_CALIBRATE_FAULT=transient``, one that fails
retryably at once (a calibrate started beside decompose that fails before decompose's verdict)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pipeline.core.errors import TransientError
from pipeline.stages.base import NO_CLIENTS, InputFile, StageClients, StageResult
from pipeline.stages.calibrate import *  # noqa: F403 - the real stage's hooks; only run is wrapped
from pipeline.stages.calibrate import Params, __all__  # noqa: F401
from pipeline.stages.calibrate import run as real_run


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    if os.environ.get("BONSAI_TEST_CALIBRATE_FAULT") == "transient":
        raise TransientError("calibrate: the source run was interrupted (a test's fault)")
    return real_run(params, inputs, workdir, clients)
