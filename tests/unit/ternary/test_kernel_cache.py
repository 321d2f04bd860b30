"""`kernel_cache.is_cold`: whether a decompose here would first compile the numba kernel (convert says so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.ternary import kernel, kernel_cache

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not kernel.is_available(), reason="numba is not installed: there is no kernel to compile")
def test_an_empty_cache_is_cold_and_a_type_without_kernel_never_is(tmp_path: Path) -> None:
    probe = ("from pipeline.ternary.kernel_cache import is_cold; "
             "print(is_cold('TQ2_0'), is_cold('q2_0'), is_cold('F16'))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "False"]


@pytest.mark.skipif(not kernel.is_available(), reason="numba is not installed: there is no kernel to compile")
def test_compiled_in_this_process_is_warm() -> None:
    kernel_cache.warm_up()  # loads (or compiles) the TQ kernel in this process
    assert kernel_cache.is_cold("TQ2_0") is False and kernel_cache.is_cold("TQ1_0") is False
    assert kernel_cache.COMPILE_ESTIMATE_S["TQ2_0"] > 0
