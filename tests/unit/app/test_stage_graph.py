"""One stage graph (issue 25, item 1): every order shown to users is a topological order of it, and a
retry re-opens a stage and what depends on it."""

from __future__ import annotations

import itertools
import re
from datetime import UTC, datetime
from pathlib import Path

from fastapi.testclient import TestClient

from pipeline.app import views
from pipeline.app.api.app import WEB_DIR, create_app
from pipeline.app.api.auth import new_token
from pipeline.app.cli.main import stage_names
from pipeline.core.settings import Settings
from pipeline.core.states import STAGE_INPUTS, STAGE_ORDER, StageName, downstream_of, upstream_of
from pipeline.db.models import Job, StageRun
from pipeline.orchestration.coordinator import retry_stages
from pipeline.stages import UPSTREAM


def _is_topological(order: list[str]) -> bool:
    position = {name: index for index, name in enumerate(order)}
    return sorted(position) == sorted(s.value for s in StageName) and all(
        position[i.value] < position[s.value] for s in StageName for i in STAGE_INPUTS[s])


def test_the_declared_order_is_topological_and_the_stages_read_the_same_graph() -> None:
    assert _is_topological([s.value for s in STAGE_ORDER])
    assert UPSTREAM is STAGE_INPUTS


def test_downstream_is_the_stage_and_its_descendants() -> None:
    for a, b in itertools.product(StageName, repeat=2):
        depends = a in upstream_of(b)
        assert (b in downstream_of(a)) == (a == b or depends), (a, b)
    for stage in StageName:
        for item in STAGE_INPUTS[stage]:
            assert set(upstream_of(item)) <= set(upstream_of(stage))
        assert retry_stages({}, stage) == downstream_of(stage)


def test_every_displayed_order_follows_the_graph(tmp_path: Path) -> None:
    assert _is_topological([s.value for s in stage_names()])
    token, entry = new_token("r", ("read",))
    client = TestClient(create_app(Settings(home=tmp_path, api_tokens=entry)))
    session = client.get("/api/session", headers={"Authorization": f"Bearer {token}"}).json()
    assert _is_topological(session["stages"])
    assert session["stage_inputs"] == {s.value: [i.value for i in STAGE_INPUTS[s]] for s in StageName}

    job = Job(id=1, source="org/name", recipe="tq2_0", params={}, status="running", priority=0)
    now = datetime.now(UTC)
    for index, stage in enumerate(reversed(list(StageName))):
        job.stage_runs.append(StageRun(id=index + 1, stage=stage.value, attempt=1, status="succeeded",
                                       shard="", metrics={}, warnings=[], created_at=now))
    shown = [run["stage"] for run in views.job_detail(job)["stages"]]
    assert _is_topological(shown)


def test_the_page_spells_no_stage_order_of_its_own() -> None:
    names = "|".join(s.value for s in StageName)
    for script in WEB_DIR.glob("*.js"):
        lists = re.findall(rf'\[\s*"(?:{names})"(?:\s*,\s*"(?:{names})")+\s*\]', script.read_text())
        assert not lists, (script.name, lists)
