"""Where a small job's time goes outside its stages: imports, database set-up, kernel load, probes.

On a ~3 MB demo Llama (SentencePiece vocabulary), in the same run:

- ``bonsai convert`` under ``python -X importtime``, timed from outside, as the second job of a
  home sees it (the database exists; a second checkpoint, so no stage is reused): its stage durations
  (``bonsai show --json``), the wall time before the first stage, between stages (when none runs)
  and after the last, and the import time of every top-level package it loads (the validate stage's
  llama.cpp probes run in child processes: their imports are measured on their own below);
- each start-up cost alone, in a fresh process: bare Python, the CLI module, torch, numba,
  llama_cpp, the database set-up (`build_runtime`: Alembic migrations on a new SQLite file and
  the check on an existing one), the compiled kernel's load, and one probe child's start;
- the same convert as the first job of a new home (its SQLite file migrated first);
- the reference: llama.cpp's own route on the same checkpoint (``convert_hf_to_gguf.py
  --outtype f16``, then ``llama_model_quantize`` to TQ2_0), found as `bench/route.py` finds it.

    .venv/bin/python bench/startup.py

Last line: ``startup: wall_s=… stages_s=… outside_s=… new_home_outside_s=… llama_s=… ratio=…``
(ratio: our wall time over llama.cpp's route). Target (issue 14): outside_s ≤ 1. On the shared
2-core machine every figure moves with the load average, printed next to them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
_OURS = ("pipeline", "workers", "bench")

# name -> (set-up, code) run in a fresh interpreter; only the code is timed, inside it.
_PROBES = {
    "import pipeline.app.cli (what `bonsai` loads first)": ("", "import pipeline.app.cli"),
    "import torch": ("", "import torch"),
    "import numba": ("", "import numba"),
    "import llama_cpp": ("", "import llama_cpp"),
    "import orchestration.bootstrap (sqlalchemy; alembic only to migrate)":
        ("", "import pipeline.orchestration.bootstrap"),
    "kernel load from numba's cache (numba imported)": (
        "import numba\nfrom pipeline.ternary import kernel_cache", "kernel_cache.warm_up()"),
}


def _python_start_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - started


def _probe_s(setup: str, code: str) -> float:
    """Seconds `code` takes in a fresh interpreter after `setup`, measured inside it."""
    timed = (setup + "\nimport time as _time; _s = _time.perf_counter()\n" + code
             + "\nprint(_time.perf_counter() - _s)")
    out = subprocess.run([sys.executable, "-c", timed], cwd=_ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _runtime_s(home: Path) -> tuple[float, float]:
    """build_runtime on a new SQLite home (migrations) and then on the same one (version check)."""
    code = ("import pipeline.orchestration.bootstrap as b, pipeline.core.settings as s, time, json\n"
            f"st = s.Settings(home={str(home)!r})\n"
            "t0 = time.perf_counter(); b.build_runtime(st); t1 = time.perf_counter()\n"
            "b._ENGINES.clear(); b.build_runtime(st); t2 = time.perf_counter()\n"
            "print(json.dumps([t1 - t0, t2 - t1]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, check=True)
    fresh, existing = json.loads(out.stdout.strip().splitlines()[-1])
    return float(fresh), float(existing)


def _probe_child_s() -> float:
    """One validate probe child's start as run_probe starts it: interpreter, pipeline, llama_cpp."""
    started = time.perf_counter()
    code = "import pipeline.calibration.probe_child, llama_cpp"
    subprocess.run([sys.executable, "-c", code], cwd=_ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(_ROOT)})
    return time.perf_counter() - started


def imports_by_package(stderr: str) -> dict[str, float]:
    """Import seconds per top-level package, from ``-X importtime`` output, adding up to the total.

    A package imported by this project's code (pipeline, workers, bench) or at top level gets
    its cumulative time (so torch's own dependencies count as torch); this project's packages
    get only their modules' own time. The standard library's modules count under their names.
    """
    lines = [m for m in map(_IMPORT_LINE.match, stderr.splitlines()) if m]
    totals: dict[str, float] = defaultdict(float)
    stack: list[tuple[int, str]] = []  # (depth, top-level package) of the enclosing imports
    for match in reversed(lines):  # importtime prints a module after its children: walk parents first
        depth, package = len(match.group(3)), match.group(4).split(".")[0]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent = stack[-1][1] if stack else None
        if package in _OURS:
            totals[package] += int(match.group(1)) / 1e6
        elif parent is None or parent in _OURS:
            totals[package] += int(match.group(2)) / 1e6  # inside another package it is that one's time
        stack.append((depth, package))
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def convert_once(ckpt: Path, home: Path, job_id: int = 1) -> dict[str, object]:
    from bench.route import _utc

    env = {**os.environ, "BONSAI_HOME": str(home), "BONSAI_OUTPUT_DIR": str(home / "out")}
    for name in ("BONSAI_DATABASE_URL", "BONSAI_BROKER_URL", "BONSAI_ARTIFACT_ROOT"):
        env.pop(name, None)
    os.sync()
    wall_started = time.time()
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeline", "convert", str(ckpt)],
                          cwd=_ROOT, env=env, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"bonsai convert failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    show = subprocess.run([sys.executable, "-m", "pipeline", "show", str(job_id), "--json"], cwd=_ROOT,
                          env=env, capture_output=True, text=True, check=True)
    stages = sorted(((s["stage"], float(s["duration_s"]), _utc(s["started_at"]), _utc(s["finished_at"]))
                     for s in json.loads(show.stdout)["stages"] if s["started_at"]), key=lambda s: s[2])
    # Stages of one job may run side by side: "inside" is the union of their intervals, and a gap is
    # time after every stage begun so far has ended and before the next one starts.
    gaps: dict[str, float] = {}
    inside_s, end = 0.0, stages[0][2]
    for index, (name, _, started, finished) in enumerate(stages):
        if index and started > end:
            gaps[f"{stages[index - 1][0]} -> {name}"] = started - end
        inside_s += max(0.0, finished - max(started, end))
        end = max(end, finished)
    return {
        "wall_s": wall_s,
        "stages": {name: seconds for name, seconds, _, _ in stages},
        "inside_s": inside_s,
        "before_first_s": stages[0][2] - wall_started,
        "gaps": gaps,
        "after_last_s": wall_started + wall_s - end,
        "imports": imports_by_package(proc.stderr),
    }


def main() -> int:
    from bench.route import locate_llama_cpp_tree, run_llama_route
    from pipeline.demo.checkpoint import write_demo_checkpoint

    tree = locate_llama_cpp_tree()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = write_demo_checkpoint(tmp / "demo", tokenizer="spm")
        other = write_demo_checkpoint(tmp / "demo-2", tokenizer="spm", seed=1)
        size_mb = sum(p.stat().st_size for p in ckpt.iterdir()) / 1e6
        # The numba cache, the page cache and the database, as a home's second job sees them.
        convert_once(ckpt, tmp / "home")
        ours = convert_once(other, tmp / "home", job_id=2)
        new_home = convert_once(ckpt, tmp / "new-home")
        llama = run_llama_route(tree, ckpt, tmp)
        costs = {"bare python start": _python_start_s()}
        costs.update({name: _probe_s(setup, code) for name, (setup, code) in _PROBES.items()})
        fresh_db_s, existing_db_s = _runtime_s(tmp / "runtime-home")
        costs["build_runtime, new SQLite home (migrations)"] = fresh_db_s
        costs["build_runtime, existing home (version check)"] = existing_db_s
        costs["validate probe child start (python + pipeline + llama_cpp)"] = _probe_child_s()
    stages_s = float(ours["inside_s"])  # type: ignore[arg-type]
    wall_s = float(ours["wall_s"])  # type: ignore[arg-type]
    new_wall_s = float(new_home["wall_s"])  # type: ignore[arg-type]
    new_outside_s = new_wall_s - float(new_home["inside_s"])  # type: ignore[arg-type]
    print(f"demo checkpoint: {size_mb:.1f} MB; bonsai convert under -X importtime (the second job of a home)")
    print(f"  wall {wall_s:.2f} s, inside stages {stages_s:.2f} s (their union: some run side by side), "
          f"outside the stages {wall_s - stages_s:.2f} s")
    print(f"  before the first stage {ours['before_first_s']:.2f} s, "
          f"after the last (to exit) {ours['after_last_s']:.2f} s")
    for name, seconds in ours["stages"].items():  # type: ignore[attr-defined]
        print(f"  stage {name:<10} {seconds:6.2f} s")
    for name, seconds in ours["gaps"].items():  # type: ignore[attr-defined]
        print(f"  gap {name:<24} {seconds:6.2f} s")
    print(f"the first job of a new home (migrations first): wall {new_wall_s:.2f} s, outside the stages "
          f"{new_outside_s:.2f} s, before the first stage {new_home['before_first_s']:.2f} s")
    print("imports inside the convert process (cumulative, top-level packages over 20 ms):")
    for name, seconds in ours["imports"].items():  # type: ignore[attr-defined]
        if seconds >= 0.02:
            print(f"  {name:<24} {seconds:6.2f} s")
    print("start-up costs, each alone in a fresh process:")
    for name, seconds in costs.items():
        print(f"  {name:<62} {seconds:6.2f} s")
    print(f"llama.cpp route on the same checkpoint: convert_hf_to_gguf {llama['convert_s']:.2f} s, "
          f"llama_model_quantize {llama['quantize_s']:.2f} s")
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores")
    print(f"startup: wall_s={wall_s:.2f} stages_s={stages_s:.2f} outside_s={wall_s - stages_s:.2f} "
          f"new_home_outside_s={new_outside_s:.2f} llama_s={llama['total_s']:.2f} "
          f"ratio={wall_s / llama['total_s']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
