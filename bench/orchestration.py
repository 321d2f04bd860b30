"""Orchestration overhead: no-op stages through Redis + PostgreSQL with 2 bonsai workers.

Side by side with bare Celery doing the same six hops per job on the same broker with
2 workers and no database (bench/celery_reference.py). Prints the median per-stage
overhead (sequential jobs, so no queueing) and throughput (many jobs at once).

    .venv/bin/python bench/orchestration.py [--jobs 200] [--latency-jobs 20] [--s3]

With `--s3` the same bonsai run is repeated with the artifact store in a SeaweedFS bucket on
loopback (each stage's outputs uploaded, inputs read through the worker cache), and the
per-stage overhead of both stores is printed side by side.

Last line: `stage_overhead_ms=… jobs_per_min=… reference_jobs_per_min=… ratio=…`
(+ `s3_stage_overhead_ms=… s3_jobs_per_min=… s3_overhead_ms=…` with --s3).
Targets: ≤ 50 ms per stage, ≥ 300 jobs/min.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis
from sqlalchemy import select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core.states import STAGE_ORDER  # noqa: E402
from pipeline.db import migrate  # noqa: E402
from pipeline.db.models import Job, StageRun  # noqa: E402
from pipeline.db.session import make_engine, make_sessionmaker, session_scope  # noqa: E402

PG_ADMIN = os.environ.get("BONSAI_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("BONSAI_TEST_REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0]
# The runs take turns, each flushing its database first: BONSAI_TEST_REDIS_DB gives all of them one
# database of their own on a shared server; else 12 (reference) and 13 (bonsai).
_SHARED_DB = os.environ.get("BONSAI_TEST_REDIS_DB")


@contextmanager
def fresh_database() -> Iterator[str]:
    name = f"bonsai_bench_{uuid.uuid4().hex[:10]}"
    admin = PG_ADMIN.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def processes(commands: list[list[str]], env: dict[str, str], log_dir: Path) -> Iterator[None]:
    procs = []
    for index, command in enumerate(commands):
        log = open(log_dir / f"proc{index}.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    try:
        yield
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def bonsai_service(tmp: Path, broker: str, stage_package: str, workers: int, name: str,
                   extra_env: dict[str, str] | None = None) -> Iterator[tuple[Any, dict[str, str]]]:
    """A database and a broker database of their own and ``workers`` bonsai workers of concurrency 1
    running ``stage_package``; yields (sessions, env) once the workers had time to connect."""
    redis.Redis.from_url(broker).flushdb()
    with fresh_database() as db_url:
        engine = make_engine(db_url)
        migrate.upgrade(engine)
        env = {**os.environ, "BONSAI_HOME": str(tmp / "home"), "BONSAI_DATABASE_URL": db_url,
               "BONSAI_BROKER_URL": broker, "BONSAI_STAGE_PACKAGE": stage_package, **(extra_env or {})}
        command = [sys.executable, "-m", "pipeline", "worker", "--concurrency", "1"]
        try:
            with processes([[*command, "--hostname", f"{name}{i}@%h"] for i in range(workers)], env, tmp):
                time.sleep(3)  # workers connect
                yield make_sessionmaker(engine), env
        finally:
            engine.dispose()


def wait_all_final(sessions, job_ids: list[int], timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    wanted = set(job_ids)
    while time.monotonic() < deadline:
        with session_scope(sessions) as session:
            open_jobs = session.scalars(
                select(Job.id).where(Job.id.in_(wanted), Job.status.not_in(("succeeded", "failed")))
            ).all()
        if not open_jobs:
            return
        time.sleep(0.05)
    raise SystemExit(f"timed out: {len(open_jobs)} jobs unfinished")


def submit(env: dict[str, str], sources: list[str]) -> list[int]:
    # `bonsai submit` checks each source's form: a bare name becomes a hub-style id the no-op stages ignore.
    sources = [name if "/" in name else f"bench/{name}" for name in sources]
    out = subprocess.run([sys.executable, "-m", "pipeline", "submit", *sources], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


def stage_overheads_ms(sessions, job_ids: list[int]) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Per stage, in ms: total (previous stage's end, or the job's creation, to this stage's end),
    and its parts: dispatch (to queued), pickup (queued to started), run (started to finished)."""
    parts: dict[str, list[float]] = {"total": [], "dispatch": [], "pickup": [], "run": []}

    def ms(later, earlier) -> float:  # type: ignore[no-untyped-def]
        return (later - earlier).total_seconds() * 1000

    with session_scope(sessions) as session:
        for job_id in job_ids:
            job = session.get_one(Job, job_id)
            runs = {r.stage: r for r in session.scalars(select(StageRun).where(StageRun.job_id == job_id))}
            previous = job.created_at
            # The job's own stages, as it ran them: a stage of STAGE_ORDER outside its graph has no run.
            for stage in (s for s in STAGE_ORDER if s.value in runs):
                run = runs[stage.value]
                parts["total"].append(ms(run.finished_at, previous))
                parts["dispatch"].append(ms(run.queued_at, previous))
                parts["pickup"].append(ms(run.started_at, run.queued_at))
                parts["run"].append(ms(run.finished_at, run.started_at))
                previous = run.finished_at
    return parts


def bench_bonsai(n_jobs: int, latency_jobs: int, tmp: Path,
                 extra_env: dict[str, str] | None = None) -> tuple[float, float, int]:
    broker = f"{REDIS_BASE}/{_SHARED_DB or 13}"
    with bonsai_service(tmp, broker, "bench.noop_stages", 2, "bench", extra_env) as (sessions, env):
        warm = submit(env, ["warmup-0", "warmup-1"])
        wait_all_final(sessions, warm, 120)
        sequential = []
        for index in range(latency_jobs):
            (job_id,) = submit(env, [f"latency-{index}"])
            wait_all_final(sessions, [job_id], 60)
            sequential.append(job_id)
        parts = stage_overheads_ms(sessions, sequential)
        overhead_ms = statistics.median(parts["total"])
        print("bonsai per-stage median ms: " + ", ".join(
            f"{name} {statistics.median(values):.1f}" for name, values in parts.items()))
        started = time.monotonic()
        batch = submit(env, [f"throughput-{i}" for i in range(n_jobs)])
        wait_all_final(sessions, batch, 900)
        elapsed_s = time.monotonic() - started
        with session_scope(sessions) as session:
            failed = len(session.scalars(select(Job.id).where(Job.status == "failed")).all())
    return overhead_ms, n_jobs / elapsed_s * 60, failed


def bench_reference(n_jobs: int, latency_jobs: int, tmp: Path) -> tuple[float, float]:
    broker = f"{REDIS_BASE}/{_SHARED_DB or 12}"
    client = redis.Redis.from_url(broker)
    client.flushdb()
    env = {**os.environ, "BENCH_BROKER_URL": broker}
    worker = [sys.executable, "-m", "celery", "-A", "bench.celery_reference", "worker", "-Q", "reference",
              "-c", "1", "-O", "fair", "--without-gossip", "--without-mingle", "--loglevel", "WARNING"]
    commands = [[*worker, "-n", f"ref{i}@%h"] for i in range(2)]
    from bench.celery_reference import HOPS, hop

    def run(ids: range) -> None:
        for job_id in ids:
            hop.apply_async((job_id, 0, time.time()))

    def wait(count: int) -> None:
        deadline = time.monotonic() + 900
        while client.hlen("reference:done") < count:
            if time.monotonic() > deadline:
                raise SystemExit("reference timed out")
            time.sleep(0.02)

    with processes(commands, env, tmp):
        hop.app.conf.broker_url = broker
        time.sleep(3)
        run(range(2))
        wait(2)
        client.delete("reference:done")
        per_hop = []
        for job_id in range(latency_jobs):
            run(range(job_id, job_id + 1))
            wait(job_id + 1)
        for value in client.hvals("reference:done"):
            start, end = map(float, value.decode().split(","))
            per_hop.append((end - start) * 1000 / HOPS)
        client.delete("reference:done")
        started = time.monotonic()
        run(range(n_jobs))
        wait(n_jobs)
        elapsed_s = time.monotonic() - started
    return statistics.median(per_hop), n_jobs / elapsed_s * 60


def bench_s3(n_jobs: int, latency_jobs: int, tmp: Path) -> tuple[float, float, int]:
    """The bonsai run again, artifacts in a bucket of a SeaweedFS server of its own on loopback."""
    from tests.support import seaweed

    server = seaweed.SeaweedServer(tmp / "seaweedfs").start()
    try:
        bucket = seaweed.new_bucket(server.endpoint_url)
        env = {**seaweed.AWS_ENV, "BONSAI_ARTIFACT_ROOT": f"s3://{bucket}/bench",
               "BONSAI_S3_ENDPOINT_URL": server.endpoint_url}
        return bench_bonsai(n_jobs, latency_jobs, tmp, env)
    finally:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--latency-jobs", type=int, default=20)
    parser.add_argument("--s3", action="store_true", help="Also run with the store in a SeaweedFS bucket.")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.latency_jobs = 4, 2
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bonsai-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "ref").mkdir()
        ref_ms, ref_jpm = bench_reference(args.jobs, args.latency_jobs, tmp / "ref")
        ours_ms, ours_jpm, failed = bench_bonsai(args.jobs, args.latency_jobs, tmp)
        s3 = bench_s3(args.jobs, args.latency_jobs, tmp / "s3") if args.s3 else None
    print(f"{'':28}{'bonsai':>12}{'bare celery':>14}{'ratio':>8}")
    print(f"{'per-stage overhead (ms)':28}{ours_ms:>12.1f}{ref_ms:>14.1f}{ours_ms / ref_ms:>8.2f}")
    print(f"{'jobs per minute':28}{ours_jpm:>12.0f}{ref_jpm:>14.0f}{ours_jpm / ref_jpm:>8.2f}")
    print(f"failed jobs: {failed} of {args.jobs}; 2 workers, concurrency 1 each, 6 no-op stages per job")
    tail = ""
    if s3 is not None:
        s3_ms, s3_jpm, s3_failed = s3
        print(f"{'':28}{'local store':>12}{'S3 store':>14}{'diff':>8}")
        print(f"{'per-stage overhead (ms)':28}{ours_ms:>12.1f}{s3_ms:>14.1f}{s3_ms - ours_ms:>8.1f}")
        print(f"{'jobs per minute':28}{ours_jpm:>12.0f}{s3_jpm:>14.0f}{s3_jpm / ours_jpm:>8.2f}")
        print(f"failed jobs with the S3 store: {s3_failed} of {args.jobs}")
        tail = (f" s3_stage_overhead_ms={s3_ms:.1f} s3_jobs_per_min={s3_jpm:.0f} "
                f"s3_overhead_ms={s3_ms - ours_ms:.1f}")
    print(f"load average after: {os.getloadavg()}")
    print(f"stage_overhead_ms={ours_ms:.1f} jobs_per_min={ours_jpm:.0f} "
          f"reference_jobs_per_min={ref_jpm:.0f} ratio={ours_jpm / ref_jpm:.2f}{tail}")


if __name__ == "__main__":
    main()
