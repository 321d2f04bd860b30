"""Load: many jobs submitted through the HTTP API at once, run by 2 workers on no-op stages.

`bonsai serve` (distributed mode, real PostgreSQL and Redis), two `bonsai worker` processes
(concurrency 1 each) and a reconciler; stages are bench/noop_stages, so what is measured is
the API and the orchestration, not the maths. Clients post one job per request from many
threads at once while a scraper reads /metrics every 0.25 s. Afterwards every job must have
succeeded, every stage of every job must have run exactly once, and every output must be
stored once (one artifact row per output, made by exactly one run).

    .venv/bin/python bench/load.py [--jobs 1000] [--clients 50]

Last line: `load: jobs=… lost=… duplicate_runs=… duplicate_artifacts=… api_p50_ms=… api_p99_ms=…
metrics_p50_ms=… metrics_p99_ms=… jobs_per_min=…`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis
from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.orchestration import REDIS_BASE, fresh_database, processes, wait_all_final  # noqa: E402
from pipeline.app.api.auth import new_token  # noqa: E402
from pipeline.db import migrate  # noqa: E402
from pipeline.db.models import Artifact, Job, RunArtifact, StageRun  # noqa: E402
from pipeline.db.session import make_engine, make_sessionmaker, session_scope  # noqa: E402
from tests.integration.conftest import free_port  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _wait_for_api(base: str, headers: dict[str, str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/api/jobs?limit=1", headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the API did not come up")


def _post_all(
    base: str, headers: dict[str, str], n_jobs: int, n_clients: int
) -> tuple[list[int], list[float]]:
    latencies: list[float] = []
    job_ids: list[int] = []
    lock = threading.Lock()

    def post(index: int) -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
            for i in range(index, n_jobs, n_clients):
                started = time.perf_counter()
                response = client.post("/api/jobs", json={"source": f"load/model-{i:05d}@main"})
                took_ms = (time.perf_counter() - started) * 1000
                response.raise_for_status()
                with lock:
                    latencies.append(took_ms)
                    job_ids.extend(response.json()["job_ids"])

    with ThreadPoolExecutor(n_clients) as pool:
        list(pool.map(post, range(n_clients)))
    return job_ids, latencies


def _scrape(base: str, headers: dict[str, str], stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        while not stop.wait(0.25):
            started = time.perf_counter()
            if client.get("/metrics").status_code == 200:
                out.append((time.perf_counter() - started) * 1000)


def _check(sessions, job_ids: list[int]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    with session_scope(sessions) as session:
        statuses = dict(session.execute(select(Job.id, Job.status).where(Job.id.in_(job_ids))).all())
        lost = sum(1 for job_id in job_ids if statuses.get(job_id) != "succeeded")
        attempts = session.execute(
            select(StageRun.job_id, StageRun.stage, func.count()).group_by(StageRun.job_id, StageRun.stage)
        ).all()
        duplicate_runs = sum(count - 1 for _job, _stage, count in attempts if count > 1)
        outputs = session.scalar(
            select(func.count()).select_from(RunArtifact).where(RunArtifact.direction == "out"))
        artifacts = session.scalar(select(func.count()).select_from(Artifact))
    duplicates = int(outputs or 0) - int(artifacts or 0)
    return {"lost": lost, "duplicate_runs": duplicate_runs, "duplicate_artifacts": duplicates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.clients = 6, 2
    token, entry = new_token("load", ("submit",))
    headers = {"Authorization": f"Bearer {token}"}
    redis_db = os.environ.get("BONSAI_TEST_REDIS_DB", "13")
    broker = f"{REDIS_BASE}/{redis_db}"
    redis.Redis.from_url(broker).flushdb()
    with fresh_database() as db_url, tempfile.TemporaryDirectory(prefix="bonsai-load-") as tmp:
        engine = make_engine(db_url)
        migrate.upgrade(engine)
        sessions = make_sessionmaker(engine)
        port = free_port()
        env = {**os.environ, "BONSAI_HOME": tmp, "BONSAI_DATABASE_URL": db_url, "BONSAI_BROKER_URL": broker,
               "BONSAI_STAGE_PACKAGE": "bench.noop_stages", "BONSAI_API_TOKENS": entry,
               "BONSAI_HEARTBEAT_S": "2", "BONSAI_HEARTBEAT_TIMEOUT_S": "30"}
        bonsai = [sys.executable, "-m", "pipeline"]
        worker = [*bonsai, "worker", "--queues", "io,cpu,gpu", "--concurrency", "1", "--hostname"]
        commands = [[*bonsai, "serve", "--port", str(port)], [*worker, "w0@%h"], [*worker, "w1@%h"],
                    [*bonsai, "reconcile", "--every", "5"]]
        with processes(commands, env, Path(tmp)):
            base = f"http://127.0.0.1:{port}"
            _wait_for_api(base, headers)
            stop, scrapes = threading.Event(), []
            scraper = threading.Thread(target=_scrape, args=(base, headers, stop, scrapes))
            scraper.start()
            started = time.monotonic()
            job_ids, latencies = _post_all(base, headers, args.jobs, args.clients)
            posted_s = time.monotonic() - started
            wait_all_final(sessions, job_ids, timeout_s=3600)
            elapsed_s = time.monotonic() - started
            stop.set()
            scraper.join()
        found = _check(sessions, job_ids)
        engine.dispose()
    load = os.getloadavg()
    print(f"submitted {len(job_ids)} jobs from {args.clients} clients in {posted_s:.1f}s; all final after "
          f"{elapsed_s:.1f}s (load average {load[0]:.1f})")
    print(f"{'':22}{'p50':>10}{'p99':>10}{'max':>10}{'n':>8}")
    for name, values in (("POST /api/jobs (ms)", latencies), ("GET /metrics (ms)", scrapes)):
        print(f"{name:22}{statistics.median(values):10.1f}{_percentile(values, 0.99):10.1f}"
              f"{max(values):10.1f}{len(values):8d}")
    print(f"lost jobs {found['lost']}, stages run more than once {found['duplicate_runs']}, "
          f"outputs stored twice {found['duplicate_artifacts']}")
    print(f"load: jobs={len(job_ids)} lost={found['lost']} duplicate_runs={found['duplicate_runs']} "
          f"duplicate_artifacts={found['duplicate_artifacts']} api_p50_ms={statistics.median(latencies):.1f} "
          f"api_p99_ms={_percentile(latencies, 0.99):.1f} metrics_p50_ms={statistics.median(scrapes):.1f} "
          f"metrics_p99_ms={_percentile(scrapes, 0.99):.1f} jobs_per_min={len(job_ids) / elapsed_s * 60:.0f}")


if __name__ == "__main__":
    main()
