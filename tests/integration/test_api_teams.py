"""Team caps over the live API (FastAPI's TestClient, PostgreSQL, embedded mode): a submission over
max_pending or the storage quota gets 429 with Retry-After and records nothing; the priority ceiling
needs the admin scope; a token's team is the job's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeline.app.api.app import create_app
from pipeline.app.api.auth import new_token
from pipeline.core.settings import Settings
from pipeline.orchestration.bootstrap import build_runtime, migrate_database

pytestmark = pytest.mark.services


@dataclass
class Service:
    client: TestClient
    app: Any
    source: str
    tokens: dict[str, str]
    team: str

    def submit(self, who: str, count: int = 1, priority: int = 0) -> Any:
        body = {"sources": [self.source] * count, "priority": priority}
        headers = {"Authorization": f"Bearer {self.tokens[who]}"}
        return self.client.post("/api/jobs", json=body, headers=headers)

    def jobs(self) -> list[dict[str, Any]]:
        response = self.client.get("/api/jobs", headers={"Authorization": f"Bearer {self.tokens['admin']}"})
        return [job for job in response.json() if job["team"] == self.team]


@pytest.fixture
def service(pg_url: str, tmp_path: Path) -> Iterator[Service]:
    source = tmp_path / "checkpoint"  # download and checksum run, then inspect fails: no weights
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    team = f"ml-{uuid.uuid4().hex[:8]}"  # the database outlives this test: a team of its own
    (tmp_path / "teams.toml").write_text(f"[team.{team}]\nmax_pending = 2\nmax_priority = 5\n"
                                         f"[team.{team}-full]\nstorage_quota_gb = 0\n")
    tokens, entries = {}, []
    members = (("ci", "submit", team), ("admin", "admin", team), ("full", "submit", f"{team}-full"))
    for who, scope, its_team in members:
        tokens[who], entry = new_token(who, (scope,), its_team)
        entries.append(entry)
    settings = Settings(home=tmp_path / "home", database_url=pg_url, api_tokens=",".join(entries),
                        source_roots=str(tmp_path), teams_file=tmp_path / "teams.toml")
    migrate_database(settings)
    app = create_app(settings, build_runtime(settings))
    with TestClient(app) as client:
        yield Service(client, app, str(source), tokens, team)


def test_over_max_pending_is_429_with_retry_after_and_records_nothing(service: Service) -> None:
    refused = service.submit("ci", count=3)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) > 0
    assert f"team {service.team} is at its cap max_pending 2" in refused.json()["detail"]
    assert service.jobs() == []
    accepted = service.submit("ci", count=2)
    assert accepted.status_code == 201, accepted.text
    assert {job["team"] for job in service.jobs()} == {service.team}


def test_teams_and_their_gauges_are_shown(service: Service) -> None:
    assert service.submit("ci").status_code == 201
    headers = {"Authorization": f"Bearer {service.tokens['admin']}"}
    rows = {row["team"]: row for row in service.client.get("/api/teams", headers=headers).json()}
    mine = rows[service.team]
    assert (mine["max_pending"], mine["max_priority"], mine["max_running"]) == (2, 5, None)
    assert mine["weight"] == 1.0 and mine["quota_used"] is None
    assert rows[f"{service.team}-full"]["storage_quota_bytes"] == 0  # configured, idle: listed too
    metrics = service.client.get("/metrics", headers=headers).text
    assert f'bonsai_team_unfinished_jobs{{team="{service.team}"}}' in metrics
    assert f'bonsai_team_stored_bytes{{team="{service.team}-full"}} 0.0' in metrics


def test_the_priority_ceiling_needs_the_admin_scope(service: Service) -> None:
    above = service.submit("ci", priority=6)
    assert above.status_code == 400 and "max_priority 5" in above.json()["detail"]
    assert service.submit("admin", priority=6).status_code == 201


def test_over_the_storage_quota_is_429_naming_gc(service: Service) -> None:
    refused = service.submit("full")
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert "storage quota" in refused.json()["detail"] and "bonsai gc" in refused.json()["detail"]


@pytest.mark.parametrize("counted_in", ["memory", "redis"])
def test_a_token_over_the_rate_limit_gets_429_with_retry_after(pg_url: str, broker_url: str, tmp_path: Path,
                                                               counted_in: str) -> None:
    name = f"poller-{uuid.uuid4().hex[:8]}"
    token, entry = new_token(name, ("read",))
    other, other_entry = new_token(f"{name}-b", ("read",))
    settings = Settings(home=tmp_path / "home", database_url=pg_url, api_tokens=f"{entry},{other_entry}",
                        api_rate_limit="3/minute", broker_url=broker_url if counted_in == "redis" else "")
    migrate_database(settings)
    with TestClient(create_app(settings, build_runtime(settings))) as client:
        def get(presented: str) -> Any:
            return client.get("/api/jobs", headers={"Authorization": f"Bearer {presented}"})

        assert [get(token).status_code for _ in range(3)] == [200, 200, 200]
        over = get(token)
        assert over.status_code == 429, over.text
        assert 0 < int(over.headers["Retry-After"]) <= 60
        assert "rate limit of 3/minute" in over.json()["detail"]
        assert get(other).status_code == 200  # counted per token


def test_a_bad_rate_limit_is_named_at_start(tmp_path: Path) -> None:
    from pipeline.core.errors import InputError

    with pytest.raises(InputError, match="BONSAI_API_RATE_LIMIT 'fast' is not a rate"):
        create_app(Settings(home=tmp_path / "home", api_rate_limit="fast"))
