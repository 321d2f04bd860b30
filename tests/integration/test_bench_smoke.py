"""Every benchmark under bench/ still runs: each one's smoke mode (tiny sizes, seconds) must exit 0
and end with its ``key=value`` line. Timings are never checked here; the benches report them.

A bench without a smoke mode yet is listed in `NO_SMOKE_YET` with what it needs; a new script must
join one list or the other, so none can rot unnoticed again (bench/orchestration.py crashed for a
while after the sensitivity stage came in, and bench/io.py after the stages' clients became one object).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.services, pytest.mark.llama, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SMOKED = ("decompose", "fairness", "fuzz", "io", "load", "orchestration", "s3_throughput", "scaling")
# Scripts that are not benches: modules the benches load (fuzz targets, celery's reference app).
MODULES = ("__init__", "celery_reference", "fuzz_targets")
NO_SMOKE_YET = {
    "calibration": "Gemma 3 270M collector runs; needs a smaller model to run in seconds",
    "fidelity": "scores llama.cpp's own Gemma files; needs a tiny model with llama.cpp's files",
    "route": "llama.cpp's converter from the sdist and transformers from the registry",
    "scale": "three model sizes beside llama.cpp's converter",
    "sensitivity": "Gemma 3 270M measured sensitivity (minutes)",
    "startup": "repeats each measurement (about 30 s); needs a repeat option",
}
_LAST_LINE = re.compile(r"(^|\s)[a-z_0-9]+=\S+")


def test_every_bench_is_smoked_or_says_why_not() -> None:
    scripts = {path.stem for path in BENCH.glob("*.py")} - set(MODULES)
    assert scripts == set(SMOKED) | set(NO_SMOKE_YET)
    for name in SMOKED:
        assert "--smoke" in (BENCH / f"{name}.py").read_text(encoding="utf-8"), name


@pytest.mark.parametrize("name", SMOKED)
def test_the_bench_runs_in_its_smoke_mode(name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert _LAST_LINE.search(last), last
