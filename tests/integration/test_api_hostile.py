"""A hostile submitter gets nothing (issue 24): the probes of the report, each a regression test.

The server runs embedded on SQLite with secrets in its environment, HF_HUB_OFFLINE=1, a hub cache
whose ``refs/main`` holds a secret instead of a sha, and source roots set. Tokens: ``reader``
(read), ``alice`` and ``mallory`` (submit), ``ops`` (admin).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from pipeline.app.api.app import create_app
from pipeline.app.api.auth import new_token
from pipeline.clients.hub import HfHubClient
from pipeline.core.settings import Settings
from pipeline.db.models import Job, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime, with_launcher
from pipeline.orchestration.job_control import JobRequest, create_jobs
from pipeline.stages.sources import SourcePolicy
from tests.support.hub_cache import REPO, build_hub_cache

SECRET = "planted-secret-5c91e2"
TOKENS = {name: new_token(name, (scope,)) for name, scope in
          (("reader", "read"), ("alice", "submit"), ("mallory", "submit"), ("ops", "admin"))}


@dataclass
class Server:
    client: TestClient
    app: Any
    tmp: Path

    def post(self, path: str, body: Any = None, who: str = "alice") -> Any:
        return self.client.post(path, json=body, headers={"Authorization": f"Bearer {TOKENS[who][0]}"})

    def get(self, path: str, who: str = "reader") -> Any:
        return self.client.get(path, headers={"Authorization": f"Bearer {TOKENS[who][0]}"})

    def job_for(self, who: str) -> int:
        """A pending job recorded as `who`'s submission, never started (so it stays cancellable)."""
        with session_scope(self.app.state.rt.sessions) as session:
            (job_id,) = create_jobs(session, [JobRequest(f"acme/other@{'a' * 40}")], f"api:{who}",
                                    SourcePolicy())
        return job_id


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    from huggingface_hub import constants

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("BONSAI_HF_TOKEN", f"hf_{SECRET}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = build_hub_cache(tmp_path / "hub", {"config.json": b"{}"})
    (repo / "refs" / "main").write_text(f"AWS_SECRET_ACCESS_KEY={SECRET}\n")
    (tmp_path / "environ").write_text(f"AWS_SECRET_ACCESS_KEY={SECRET}\n")
    (tmp_path / "models").mkdir()
    settings = Settings(home=tmp_path / "home", source_roots=str(tmp_path / "models"),
                        api_tokens=",".join(entry for _, entry in TOKENS.values()))
    base = build_runtime(settings)
    hub = HfHubClient(cache_dir=tmp_path / "hub", is_offline=True, token=f"hf_{SECRET}", token_repos=())
    rt = with_launcher(replace(base, clients=replace(base.clients, hub=hub)), settings)
    app = create_app(settings, rt)
    with TestClient(app) as client:
        yield Server(client, app, tmp_path)


def _stored_text(server: Server) -> str:
    """Every message, traceback and log line the database holds, and what the API serves of jobs."""
    with session_scope(server.app.state.rt.sessions) as session:
        rows = [*session.scalars(select(Job)), *session.scalars(select(StageRun))]
        columns = ("error_message", "error_traceback", "log_text", "source", "warnings", "metrics")
        texts = [str(getattr(row, column, None) or "") for row in rows for column in columns]
    listing = server.get("/api/jobs").text
    details = [server.get(f"/api/jobs/{job['id']}").text for job in server.get("/api/jobs").json()]
    return "\n".join([*texts, listing, *details])


@pytest.mark.parametrize(("source", "status"), [
    ("acme/tiny-llama@/proc/self/environ", 400),                # finding 1: a path as a revision
    ("acme/tiny-llama@ENVIRON", 400),
    ("acme/tiny-llama@refs/../../../environ", 400),
    ("/" + "a" * 5000, 400),                                    # finding 4: ENAMETOOLONG was a 500
    ("/proc/1/root", 400),                                      # PermissionError was a 500
    ("acme/tiny-llama@\x1b]0;pwned\x07\x1b[2J", 400),           # finding 5: terminal escapes
])
def test_hostile_sources_are_4xx_with_a_message_and_record_nothing(server: Server, source: str,
                                                                    status: int) -> None:
    source = source.replace("ENVIRON", str(server.tmp / "environ"))
    answer = server.post("/api/jobs", {"source": source})
    assert answer.status_code == status, answer.text
    assert answer.json()["detail"] and SECRET not in answer.text
    assert server.get("/api/jobs").json() == []


def test_an_absurd_priority_is_refused_not_a_500(server: Server) -> None:
    for priority in (1e20, 10**30, -(10**30)):
        answer = server.post("/api/jobs", {"source": "acme/tiny-llama@main", "priority": priority})
        assert answer.status_code == 422, answer.text
    assert server.get("/api/jobs").json() == []


def test_no_path_oracle_outside_the_roots(server: Server) -> None:
    (server.tmp / "shadow").write_text("root:x")
    answers = [server.post("/api/jobs", {"source": str(server.tmp / name)}).json()["detail"]
               for name in ("shadow", "nonexistent", "models/../shadow")]
    shapes = {detail.split("'")[0] + detail.split("'")[2] for detail in answers}
    assert len(shapes) == 1 and "outside the allowed model folders" in answers[0], answers


def test_what_a_hub_cache_file_holds_never_reaches_a_stored_message(server: Server) -> None:
    answer = server.post("/api/jobs", {"source": f"{REPO}@main"})
    assert answer.status_code == 201, answer.text
    (job_id,) = answer.json()["job_ids"]
    server.app.state.launcher.wait(job_id, timeout_s=60)
    detail = server.get(f"/api/jobs/{job_id}").json()
    assert detail["status"] == "failed"
    assert "other than a 40-character commit sha" in detail["error_message"]
    assert SECRET not in _stored_text(server)


def test_only_the_submitter_or_an_admin_changes_a_job(server: Server) -> None:
    mine, theirs = server.job_for("alice"), server.job_for("mallory")
    for action, body in (("cancel", None), ("retry", {}), ("publish", {"to": str(server.tmp / "x")})):
        refused = server.post(f"/api/jobs/{mine}/{action}", body, who="mallory")
        assert refused.status_code == 403, (action, refused.text)
        assert "only the token that submitted it" in refused.json()["detail"]
        assert server.post(f"/api/jobs/{mine}/{action}", body, who="reader").status_code == 403
    assert server.get(f"/api/jobs/{mine}").json()["status"] == "pending"
    cancelled = server.post(f"/api/jobs/{mine}/cancel", who="alice")
    assert cancelled.status_code == 200, cancelled.text
    assert server.get(f"/api/jobs/{mine}").json()["error_message"] == "cancelled by api:alice"
    assert server.post(f"/api/jobs/{theirs}/cancel", who="ops").status_code == 200
    assert server.get(f"/api/jobs/{theirs}").json()["error_message"] == "cancelled by api:ops"
    session = server.get("/api/session", who="alice").json()
    assert session["actor"] == "api:alice" and session["is_admin"] is False


def test_publish_is_off_until_the_operator_names_where(server: Server) -> None:
    job_id = server.job_for("alice")
    answer = server.post(f"/api/jobs/{job_id}/publish", {"to": str(server.tmp / "bundle"), "force": True})
    assert answer.status_code == 400 and "BONSAI_PUBLISH_ROOTS" in answer.json()["detail"]
    assert not (server.tmp / "bundle").exists()


def test_answers_carry_no_server_paths_or_process_ids(server: Server) -> None:
    checkpoint = server.tmp / "models" / "ckpt"  # download and checksum run, inspect fails: no weights
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "llama"}\n')
    (job_id,) = server.post("/api/jobs", {"source": str(checkpoint)}).json()["job_ids"]
    server.app.state.launcher.wait(job_id, timeout_s=60)
    detail = server.get(f"/api/jobs/{job_id}").json()
    outputs = [out for run in detail["stages"] for out in run["outputs"]]
    assert outputs
    assert all(out["uri"] == f"local:sha256/{out['sha256']}" and "path" not in out for out in outputs)
    assert all(":" not in (run["worker_host"] or "") for run in detail["stages"])
    provenance = server.get(f"/api/artifacts/{outputs[0]['sha256']}/provenance").text
    assert "file://" not in provenance and str(server.app.state.settings.home) not in provenance
