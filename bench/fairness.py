"""Fair share under a flood: no-op stages through Redis + PostgreSQL with 2 bonsai workers.

Team A submits ``--flood`` jobs at priority 1,000,000; once its first stage has run, team B submits 3
at priority 0. Before admission, every message of the flood sat on the broker ahead of B's (at a
higher broker priority), so all of A ran before B's first stage. Prints, from the rows:

- a_done_while_b_waited: A's jobs that finished between B's submission and B's first stage start
  (target ≤ 2 × workers);
- b_first_start_s: B's submission to its first stage's start; b_done_s: to B's last job's end;
- a_done_s: A's submission to A's last job's end;
- share_b: B's fraction of the attempts started while both teams had work (target: within 0.1 of its
  weighted share, 0.5 for two teams of weight 1).

    .venv/bin/python bench/fairness.py [--flood 200] [--smoke]

Last line: `fairness: a_done_while_b_waited=… b_first_start_s=… b_done_s=… a_done_s=… share_b=…`
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.orchestration import REDIS_BASE, bonsai_service, wait_all_final  # noqa: E402
from pipeline.db.models import Job, StageRun  # noqa: E402
from pipeline.db.session import session_scope  # noqa: E402

WORKERS = 2
LATE = 3
_SHARED_DB = os.environ.get("BONSAI_TEST_REDIS_DB")


def submit(env: dict[str, str], team: str, sources: list[str], priority: int) -> list[int]:
    command = [sys.executable, "-m", "pipeline", "submit", *sources, "--priority", str(priority)]
    out = subprocess.run(command, env={**env, "BONSAI_TEAM": team}, cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return [int(x) for x in out.stdout.split()]


def measure(sessions, flood: list[int], late: list[int]) -> dict[str, float]:  # type: ignore[no-untyped-def]
    with session_scope(sessions) as session:
        jobs = {job.id: job for job in session.scalars(select(Job))}
        runs = list(session.scalars(select(StageRun).where(StageRun.started_at.is_not(None))))
        a_sent = min(jobs[i].created_at for i in flood)
        b_sent = min(jobs[i].created_at for i in late)
        b_first = min(run.started_at for run in runs if run.job_id in late)
        b_done = max(jobs[i].finished_at for i in late)
        a_done = max(jobs[i].finished_at for i in flood)
        both_until = min(b_done, a_done)
        started = [run for run in runs if b_sent <= run.started_at <= both_until]
        b_started = sum(1 for run in started if run.job_id in late)
        return {
            "a_done_while_b_waited": sum(1 for i in flood if b_sent < jobs[i].finished_at < b_first),
            "b_first_start_s": (b_first - b_sent).total_seconds(),
            "b_done_s": (b_done - b_sent).total_seconds(),
            "a_done_s": (a_done - a_sent).total_seconds(),
            "share_b": b_started / len(started) if started else 0.0,
        }


def run(flood_jobs: int, tmp: Path) -> dict[str, float]:
    broker = f"{REDIS_BASE}/{_SHARED_DB or 13}"
    with bonsai_service(tmp, broker, "bench.noop_stages", WORKERS, "fair") as (sessions, env):
        flood = submit(env, "team-a", [f"bench/flood-{i}" for i in range(flood_jobs)], 1_000_000)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with session_scope(sessions) as session:
                if session.scalar(select(StageRun.id).where(StageRun.status == "succeeded").limit(1)):
                    break
            time.sleep(0.05)
        late = submit(env, "team-b", [f"bench/late-{i}" for i in range(LATE)], 0)
        wait_all_final(sessions, flood + late, 900)
        return measure(sessions, flood, late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=200, help="team A's jobs")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: CI runs it to prove the bench runs (figures meaningless)")
    args = parser.parse_args()
    if args.smoke:
        args.flood = 8
    with tempfile.TemporaryDirectory(prefix="bonsai-fair-") as tmp_name:
        figures = run(args.flood, Path(tmp_name))
    print(f"{WORKERS} workers of concurrency 1; team A: {args.flood} jobs at priority 1,000,000, then "
          f"team B: {LATE} at 0; 6 no-op stages per job")
    print(f"{'':28}{'measured':>10}{'target':>12}")
    waited = figures["a_done_while_b_waited"]
    print(f"{'A done while B waited':28}{waited:>10.0f}{'<= ' + str(2 * WORKERS):>12}")
    print(f"{'B share of the slots':28}{figures['share_b']:>10.2f}{'0.5 +- 0.1':>12}")
    print(f"{'B first start (s)':28}{figures['b_first_start_s']:>10.2f}")
    print(f"{'B done (s)':28}{figures['b_done_s']:>10.2f}")
    print(f"{'A done (s)':28}{figures['a_done_s']:>10.2f}")
    print("fairness: " + " ".join(
        f"{key}={value:.0f}" if key == "a_done_while_b_waited" else f"{key}={value:.2f}"
        for key, value in figures.items()))


if __name__ == "__main__":
    main()
