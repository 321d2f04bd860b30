"""Worker scaling: a CPU-bound stage's throughput with 1 and 2 worker processes on this machine.

Real `bonsai worker` processes (Celery, Redis broker, PostgreSQL) run jobs whose decompose
stage is the real one on a fixed 201M-parameter checkpoint and whose other stages are no-ops
(`bench.scaling_stages`). Throughput is decompose runs per minute, from the first decompose
start to the last decompose end as recorded in the database, so submission and the no-op
stages do not count. Each configuration gets a fresh database and broker database:

- 1 worker and 2 workers with ``BONSAI_WORKER_THREADS=1`` (each worker one core);
- 1 worker and 2 workers with the libraries' default threads (every worker takes every core).

    .venv/bin/python bench/scaling.py [--jobs 12]

Uses BONSAI_TEST_PG_URL and BONSAI_TEST_REDIS_URL (defaults: local PostgreSQL and Redis) and
the Redis database BONSAI_BENCH_REDIS_DB (default 11), which it flushes.

Last line: ``scaling: one_worker_per_min=… two_workers_per_min=… speedup=… default_threads_speedup=…``.
Target: speedup ≥ 1.8 (two single-thread workers against one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from sqlalchemy import select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.orchestration import REDIS_BASE, bonsai_service, submit, wait_all_final  # noqa: E402
from pipeline.db.models import StageRun  # noqa: E402
from pipeline.db.session import session_scope  # noqa: E402

# 8 layers of the route checkpoint's shape (201M parameters, 403 MB): about 1 s of decompose on one core.
SHAPE = {"n_layers": 8, "hidden": 1536, "intermediate": 4096, "n_heads": 12, "n_kv_heads": 4}
CONFIGS = ((1, 1), (2, 1), (1, 0), (2, 0))  # (workers, BONSAI_WORKER_THREADS; 0 = libraries' default)


def prepare(folder: Path, shape: dict[str, int]) -> Path:
    """The checkpoint of ``shape`` and its model card, as the scaling stages read them."""
    from bench.decompose import model_card
    from pipeline.demo.checkpoint import write_demo_checkpoint

    ckpt = write_demo_checkpoint(folder / "ckpt", **shape)
    (folder / "model_card.json").write_text(json.dumps(model_card(ckpt)))
    return folder


def decompose_windows(sessions, job_ids: list[int]) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    """Seconds from the first decompose start to the last decompose end, and each run's duration."""
    with session_scope(sessions) as session:
        runs = session.scalars(select(StageRun).where(StageRun.job_id.in_(job_ids),
                                                      StageRun.stage == "decompose")).all()
        if len(runs) != len(job_ids) or any(r.status != "succeeded" for r in runs):
            raise SystemExit(f"decompose did not succeed everywhere: {[(r.job_id, r.status) for r in runs]}")
        window_s = (max(r.finished_at for r in runs) - min(r.started_at for r in runs)).total_seconds()
        return window_s, [float(r.duration_s) for r in runs]


def bench_config(workers: int, threads: int, n_jobs: int, ckpt: Path, tmp: Path) -> dict[str, float]:
    broker = f"{REDIS_BASE}/{os.environ.get('BONSAI_BENCH_REDIS_DB', '11')}"
    extra = {"BENCH_SCALING_CKPT": str(ckpt), "BONSAI_WORKER_THREADS": str(threads)}
    with bonsai_service(tmp, broker, "bench.scaling_stages", workers, "scale", extra) as (sessions, env):
        warm = submit(env, [f"warmup-{i}" for i in range(workers)])
        wait_all_final(sessions, warm, 300)
        batch = submit(env, [f"job-{i}" for i in range(n_jobs)])
        wait_all_final(sessions, batch, 900)
        window_s, durations = decompose_windows(sessions, batch)
    return {"per_min": n_jobs / window_s * 60, "window_s": window_s,
            "median_stage_s": statistics.median(durations)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args()
    if args.smoke:
        args.jobs = 2
    load_before = os.getloadavg()
    results: dict[tuple[int, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bonsai-scaling-") as tmp_name:
        tmp = Path(tmp_name)
        from bench.route import SMOKE_SHAPE

        ckpt = prepare(tmp / "checkpoint", SMOKE_SHAPE if args.smoke else SHAPE)
        for workers, threads in CONFIGS:
            work = tmp / f"w{workers}t{threads}"
            work.mkdir()
            results[(workers, threads)] = bench_config(workers, threads, args.jobs, ckpt, work)
    cores = os.cpu_count() or 1
    print(f"{args.jobs} jobs per configuration, decompose of a 201M-parameter checkpoint, {cores} cores")
    print(f"{'workers x threads each':26}{'decompose/min':>15}{'window (s)':>12}{'median stage (s)':>18}")
    for (workers, threads), result in results.items():
        label = f"{workers} x {threads if threads else f'default ({cores})'}"
        print(f"{label:26}{result['per_min']:>15.1f}{result['window_s']:>12.2f}{result['median_stage_s']:>18.2f}")
    print("load average (1, 5, 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
          + ", after " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {cores} cores")
    one, two = results[(1, 1)]["per_min"], results[(2, 1)]["per_min"]
    default_speedup = results[(2, 0)]["per_min"] / results[(1, 0)]["per_min"]
    print(f"scaling: one_worker_per_min={one:.1f} two_workers_per_min={two:.1f} speedup={two / one:.2f} "
          f"default_threads_speedup={default_speedup:.2f}")


if __name__ == "__main__":
    main()
