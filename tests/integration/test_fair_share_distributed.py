"""Fair share on the real things: `bonsai worker` processes, Redis, PostgreSQL, no-op stages. One team
floods the service at a high priority; another team's first attempt then starts within about a slot
per worker, not after the flood."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster

pytestmark = [pytest.mark.services, pytest.mark.slow]

WORKERS = 2
FLOOD = 80


@pytest.fixture
def cluster(pg_url: str, broker_url: str, tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path / "home", pg_url, broker_url, {"BONSAI_STAGE_PACKAGE": "bench.noop_stages"})
    made.home.mkdir()
    upgrade = made.bonsai("db", "upgrade")
    assert upgrade.returncode == 0, upgrade.stderr
    yield made
    made.stop()


def test_a_flood_does_not_hold_back_another_teams_first_attempt(cluster: Cluster) -> None:
    for _ in range(WORKERS):
        cluster.start_worker()
    flood = cluster.submit(*[f"acme/flood-{i}" for i in range(FLOOD)], options=["--priority", "1000000"],
                           team="team-a")
    cluster.wait_for(lambda: any(run.status == "succeeded" for run in cluster.runs()), 60,
                     "the flood to start")
    late = cluster.submit(*[f"acme/late-{i}" for i in range(3)], options=[], team="team-b")
    statuses = cluster.wait_jobs_final(flood + late, timeout_s=240)
    assert set(statuses.values()) == {"succeeded"}, statuses

    jobs = {job.id: job for job in cluster.jobs()}
    assert {jobs[i].team for i in flood} == {"team-a"} and {jobs[i].team for i in late} == {"team-b"}
    runs = cluster.runs()
    b_submitted = min(jobs[i].created_at for i in late)
    b_first = min(run.started_at for run in runs if run.job_id in late and run.started_at)
    a_done_while_b_waited = sum(1 for i in flood if jobs[i].finished_at and b_submitted < jobs[i].finished_at
                                < b_first)
    a_left = sum(1 for i in flood if jobs[i].finished_at and jobs[i].finished_at > b_first)
    assert a_left > 2 * WORKERS, f"the flood ended before team B came ({a_left} jobs left): make it longer"
    # Before admission, every message of the flood was on the broker ahead of team B's: all of it ran first.
    assert a_done_while_b_waited <= 2 * WORKERS, (a_done_while_b_waited, a_left)
    b_done = max(jobs[i].finished_at for i in late if jobs[i].finished_at)
    a_done = max(jobs[i].finished_at for i in flood if jobs[i].finished_at)
    assert b_done < a_done, "team B's three jobs finish while the flood still runs"
