"""The real decompose stage, preceded by the fault ``BONSAI_TEST_DECOMPOSE_FAULT`` names."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from pipeline.stages.base import NO_CLIENTS, InputFile, StageClients, StageResult
from pipeline.stages.decompose import *  # noqa: F403 - the real stage's hooks; only run is wrapped
from pipeline.stages.decompose import Params, __all__  # noqa: F401
from pipeline.stages.decompose import run as real_run

_CHUNK_BYTES = 64 << 20
_MAX_HOG_BYTES = 6 << 30  # never past this, whatever happens


def _hog() -> None:
    chunks = []
    while len(chunks) * _CHUNK_BYTES < _MAX_HOG_BYTES:
        chunk = bytearray(_CHUNK_BYTES)
        chunk[::4096] = b"\x01" * (_CHUNK_BYTES // 4096)  # touch every page: resident, not just reserved
        chunks.append(chunk)
        time.sleep(0.02)
    raise RuntimeError("the memory hog reached its own limit without being stopped")


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    fault = os.environ.get("BONSAI_TEST_DECOMPOSE_FAULT", "")
    if fault.startswith("delay:"):
        time.sleep(float(fault.split(":", 1)[1]))
    elif fault == "hog":
        _hog()
    elif fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_run(params, inputs, workdir, clients)
