"""BONSAI_WORKER_THREADS: each worker process gives numba and torch that many threads, set at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import InputError
from pipeline.core.settings import Settings

_ROOT = Path(__file__).resolve().parents[2]


def _threads_after(code: str) -> dict[str, int | str]:
    probe = (
        "import json, os, sys\n"
        "from pipeline.orchestration.threads import limit_threads\n"
        f"{code}\n"
        "import numba, torch\n"
        "print(json.dumps({'numba': numba.get_num_threads(), 'torch': torch.get_num_threads(),\n"
        "                  'wait': os.environ.get('OMP_WAIT_POLICY')}))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=_ROOT, capture_output=True, text=True, check=True,
                         env=env)
    result: dict[str, int | str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_limit_before_the_libraries_load() -> None:
    assert _threads_after("limit_threads(1)") == {"numba": 1, "torch": 1, "wait": "PASSIVE"}


def test_zero_leaves_the_defaults_and_a_limit_reaches_loaded_libraries() -> None:
    code = (
        "import numba, torch\n"
        "defaults = (numba.get_num_threads(), torch.get_num_threads())\n"
        "limit_threads(0)\n"
        "assert (numba.get_num_threads(), torch.get_num_threads()) == defaults, defaults\n"
        "limit_threads(1)"
    )
    assert _threads_after(code) == {"numba": 1, "torch": 1, "wait": "PASSIVE"}


def test_negative_is_refused() -> None:
    with pytest.raises(InputError, match="BONSAI_WORKER_THREADS"):
        Settings(worker_threads=-1).validate_all()
