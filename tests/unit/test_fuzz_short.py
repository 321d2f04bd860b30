"""A short seeded run of every fuzz target (bench/fuzz.py): no parser may raise anything but the
project's own errors, take over 1 s on an input, or grow memory past the bound.

The long runs (1,000,000 inputs per target) are bench/fuzz.py's job, not the test suite's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 1000
TARGETS = ("safetensors", "config", "tokenizer", "spm", "gguf", "sha256sums", "manifest")


def test_every_target_runs_seeded_without_findings(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is in the test extra (pip install -e '.[test]')")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fuzz.py"), "--runs", str(RUNS), "--seed", "7",
         "--out", str(tmp_path / "findings")],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    figures = dict(re.findall(r"(\w+)=(\d+/\d+)", last))
    assert sorted(figures) == sorted(TARGETS), last
    for target, figure in figures.items():
        inputs, findings = (int(x) for x in figure.split("/"))
        assert inputs == RUNS and findings == 0, f"{target}: {figure}\n{proc.stdout[-3000:]}"
    assert last.endswith("total_findings=0"), last
