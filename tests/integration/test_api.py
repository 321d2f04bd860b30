"""The HTTP API in process (FastAPI's TestClient) on the real PostgreSQL server, embedded mode.

Jobs are real: a folder holding a config and a note runs download and checksum for real,
then stops at inspect (no weights), in well under a second, through the API's own
background launcher.
"""

from __future__ import annotations

import hashlib
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

READ_TOKEN, READ_ENTRY = new_token("dashboard", ("read",))
SUBMIT_TOKEN, SUBMIT_ENTRY = new_token("ci", ("submit",))
ADMIN_TOKEN, ADMIN_ENTRY = new_token("ops", ("admin",))


@dataclass
class Api:
    client: TestClient
    app: Any
    source: Path

    def get(self, path: str, token: str = READ_TOKEN) -> Any:
        return self.client.get(path, headers={"Authorization": f"Bearer {token}"})

    def post(self, path: str, body: Any = None, token: str = SUBMIT_TOKEN) -> Any:
        return self.client.post(path, json=body, headers={"Authorization": f"Bearer {token}"})

    def submit_and_wait(self) -> dict[str, Any]:
        response = self.post("/api/jobs", {"source": str(self.source), "options": {"method": "absmean"}})
        assert response.status_code == 201, response.text
        [job_id] = response.json()["job_ids"]
        self.app.state.launcher.wait(job_id, timeout_s=60)
        detail = self.get(f"/api/jobs/{job_id}").json()
        assert detail["status"] == "failed", detail
        return detail  # type: ignore[no-any-return]


@pytest.fixture
def api(pg_url: str, tmp_path: Path) -> Iterator[Api]:
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    (source / "tokenizer_config.json").write_text("no weights here\n")
    settings = Settings(
        home=tmp_path / "home", database_url=pg_url, api_tokens=f"{READ_ENTRY},{SUBMIT_ENTRY},{ADMIN_ENTRY}",
        source_roots=str(tmp_path),
    )
    migrate_database(settings)
    app = create_app(settings, build_runtime(settings))
    with TestClient(app) as client:
        yield Api(client, app, source)


def _concrete(path: str) -> str:
    return path.replace("{job_id}", "1").replace("{ref}", "a" * 64)


def test_every_data_route_refuses_missing_and_unknown_tokens(api: Api) -> None:
    # The schema lists every API route (the page's static files are the only ones left out).
    routes = [(m.upper(), path) for path, item in api.app.openapi()["paths"].items() for m in item]
    routes.append(("GET", "/openapi.json"))
    assert len(routes) >= 10
    for method, path in routes:
        bare = api.client.request(method, _concrete(path))
        assert bare.status_code == 401, (method, path, bare.text)
        assert bare.headers["WWW-Authenticate"].startswith("Bearer")
        wrong = api.client.request(method, _concrete(path), headers={"Authorization": "Bearer bonsai_nope"})
        assert wrong.status_code == 401, (method, path)
        basic = api.client.request(method, _concrete(path), headers={"Authorization": f"Basic {READ_TOKEN}"})
        assert basic.status_code == 401, (method, path)


def test_read_token_cannot_change_jobs_but_submit_token_can_read(api: Api) -> None:
    for path, body in [
        ("/api/jobs", {"source": str(api.source)}),
        ("/api/jobs/1/retry", {}),
        ("/api/jobs/1/cancel", None),
    ]:
        response = api.post(path, body, token=READ_TOKEN)
        assert response.status_code == 403, path
        assert response.json()["detail"] == "token 'dashboard' lacks the 'submit' scope"
    assert api.get("/api/jobs").json() == [], "nothing was recorded by the refused submission"
    assert api.get("/api/jobs", token=SUBMIT_TOKEN).status_code == 200
    # ... but each refusal is one row of the action account: who tried what, and why it was refused.
    refusals = api.get("/api/history?action=refused").json()
    assert [(row["actor"], row["target"]) for row in refusals] == [
        ("api:dashboard", "POST /api/jobs"), ("api:dashboard", "POST /api/jobs/1/retry"),
        ("api:dashboard", "POST /api/jobs/1/cancel")]
    assert all(row["outcome"] == "token 'dashboard' lacks the 'submit' scope" for row in refusals)


def test_session_tells_the_page_what_the_token_may_do(api: Api, tmp_path: Path) -> None:
    reader = api.get("/api/session").json()
    assert reader["token"] == "dashboard" and reader["scopes"] == ["read"]
    assert reader["can_submit"] is False
    assert "read scope only" in reader["read_only_reason"]
    assert "bonsai api-token NAME --scope submit" in reader["read_only_reason"]
    assert reader["source_roots"] == [], "server folders are shown only to those who may submit"

    submitter = api.get("/api/session", token=SUBMIT_TOKEN).json()
    assert submitter["scopes"] == ["read", "submit"] and submitter["can_submit"] is True
    assert submitter["read_only_reason"] is None
    assert submitter["source_roots"] == [str(tmp_path)]
    assert {"tq2_0", "tq1_0", "q2_0", "q1_0"} <= set(submitter["recipes"])
    assert submitter["default_recipe"] in submitter["recipes"]
    assert submitter["stages"][0] == "download" and submitter["stages"][-1] == "validate"


def test_submit_list_detail_retry_and_cancel(api: Api) -> None:
    detail = api.submit_and_wait()
    job_id = detail["id"]

    assert detail["submitted_by"] == "api:ci"
    assert [(r["stage"], r["status"]) for r in detail["stages"]] == [
        ("download", "succeeded"),
        ("checksum", "succeeded"),
        ("inspect", "failed"),
    ]
    assert "no .safetensors weights" in detail["error_message"]
    assert all("path" not in out for run in detail["stages"] for out in run["outputs"]), "no server paths"

    assert [j["id"] for j in api.get("/api/jobs?status=failed&recipe=tq2_0").json()] == [job_id]
    assert api.get("/api/jobs?status=succeeded").json() == []
    assert [j["id"] for j in api.get(f"/api/jobs?source={api.source.name}").json()] == [job_id]
    assert api.get("/api/jobs?source=elsewhere").json() == []
    assert api.get("/api/jobs?status=bogus").status_code == 422
    assert api.get("/api/jobs/999").status_code == 404
    # Against another job: the allocation diff, here an answer that neither job made one.
    compared = api.get(f"/api/jobs/{job_id}?against={job_id}").json()["allocation_diff"]
    assert compared["same_source"] and "made no auto allocation" in compared["error"]
    assert api.get(f"/api/jobs/{job_id}?against=999").status_code == 404
    assert api.get(f"/api/jobs/{job_id}?against=0").status_code == 422

    retried = api.post(f"/api/jobs/{job_id}/retry", {"from_stage": "inspect"})
    assert retried.status_code == 200, retried.text
    assert len(retried.json()["run_ids"]) == 5  # inspect and the four stages after it
    api.app.state.launcher.wait(job_id, timeout_s=60)
    attempts = [
        (r["stage"], r["attempt"], r["status"]) for r in api.get(f"/api/jobs/{job_id}").json()["stages"]
    ]
    assert ("inspect", 1, "failed") in attempts and ("inspect", 2, "failed") in attempts

    given_up = api.post(f"/api/jobs/{job_id}/cancel")
    assert given_up.status_code == 200 and given_up.json()["revoked"] == 0
    message = api.get(f"/api/jobs/{job_id}").json()["error_message"]
    assert message.startswith("cancelled by api:ci after it failed: inspect failed"), message
    refused = api.post(f"/api/jobs/{job_id}/cancel")
    assert refused.status_code == 400 and "already cancelled" in refused.json()["detail"]
    assert api.post("/api/jobs/999/cancel").status_code == 404


def test_submission_is_checked_before_anything_is_recorded(api: Api) -> None:
    secret = api.post("/api/jobs", {"source": str(api.source), "options": {"hf_token": "hf_x"}})
    assert secret.status_code == 422 and "BONSAI_HF_TOKEN" in secret.text
    recipe = api.post("/api/jobs", {"source": str(api.source), "recipe": "int4"})
    assert recipe.status_code == 400 and "unknown recipe 'int4'" in recipe.json()["detail"]
    assert api.post("/api/jobs", {"sources": []}).status_code == 422
    assert api.get("/api/jobs").json() == []


def test_artifact_download_provenance_and_chain(api: Api) -> None:
    detail = api.submit_and_wait()
    manifest = next(o for o in detail["stages"][1]["outputs"] if o["name"] == "manifest.json")

    download = api.get(f"/api/artifacts/{manifest['sha256'][:12]}/download")
    assert download.status_code == 200
    assert hashlib.sha256(download.content).hexdigest() == manifest["sha256"]
    assert download.headers["content-type"].startswith("application/json")
    assert 'filename="manifest.json"' in download.headers["content-disposition"]

    record = api.get(f"/api/artifacts/{manifest['sha256']}").json()
    assert record["kind"] == "manifest" and record["size_bytes"] == manifest["size_bytes"]
    assert [(link["stage"], link["direction"], link["name"]) for link in record["links"]] == [
        ("checksum", "out", "manifest.json")
    ]

    statements = api.get(f"/api/artifacts/{manifest['sha256']}/provenance").json()["statements"]
    assert len(statements) == 1 and statements[0]["envelopes"] == []
    deps = statements[0]["statement"]["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert [d["name"] for d in deps] == ["download/config.json", "download/tokenizer_config.json"]

    chain = api.get(f"/api/artifacts/{manifest['sha256']}/chain?verify=true").json()
    assert chain["ok"] and chain["rehashed"] and chain["artifacts"] == 3
    assert api.get("/api/artifacts/0123456789/download").status_code == 404


def test_metrics_come_from_the_database(api: Api) -> None:
    api.submit_and_wait()
    text = api.get("/metrics").text

    for line in [
        'bonsai_jobs{status="failed"} 1.0',
        'bonsai_jobs{status="succeeded"} 0.0',
        'bonsai_stage_runs{stage="download",status="succeeded"} 1.0',
        'bonsai_stage_duration_seconds_count{stage="checksum",status="succeeded"} 1.0',
        'bonsai_stage_duration_seconds_bucket{le="+Inf",stage="inspect",status="failed"} 1.0',
        'bonsai_queue_depth{queue="io"} 0.0',
        'bonsai_queue_depth{queue="gpu"} 0.0',
        'bonsai_stage_failures_total{error_kind="permanent",stage="inspect"} 1.0',
    ]:
        assert line in text, line


def test_openapi_and_the_web_page(api: Api) -> None:
    schema = api.get("/openapi.json").json()
    assert {"/api/jobs", "/api/jobs/{job_id}/retry", "/api/artifacts/{ref}/download", "/metrics"} <= set(
        schema["paths"]
    )
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"

    page = api.client.get("/")
    assert page.status_code == 200 and "<title>Bonsai Pipeline</title>" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert api.client.get("/web/app.js").status_code == 200
    assert api.client.get("/docs").status_code == 404, "no Swagger UI: its assets would come from a CDN"


def test_healthz_needs_no_token_and_checks_the_database(api: Api) -> None:
    response = api.client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_server_files_cannot_be_taken_through_the_api(pg_url: str, tmp_path: Path) -> None:
    """Finding 1 of issue 15: a folder of the server named as a source stored every file below it,
    and any read token could then download them (an `id_rsa` came back byte for byte)."""
    secrets = tmp_path / "server-home" / ".ssh"
    secrets.mkdir(parents=True)
    (secrets / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n")
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "escape").symlink_to(secrets)
    for roots in ("", str(models)):
        settings = Settings(home=tmp_path / f"home{len(roots)}", database_url=pg_url,
                            api_tokens=f"{READ_ENTRY},{SUBMIT_ENTRY},{ADMIN_ENTRY}", source_roots=roots)
        migrate_database(settings)
        app = create_app(settings, build_runtime(settings))
        with TestClient(app) as client:
            api = Api(client, app, models)
            for source in (str(secrets), str(secrets / ".."), str(models / "llama" / "escape"),
                           f"{models}/../server-home/.ssh"):
                response = api.post("/api/jobs", {"source": source})
                assert response.status_code == 400, (roots, source, response.text)
                detail = response.json()["detail"]
                assert "BONSAI_SOURCE_ROOTS" in detail, detail
            response = api.post("/api/jobs", {"sources": ["org/name@main", str(secrets)]})
            assert response.status_code == 400  # one bad source: none of them is recorded
            assert api.get("/api/jobs").json() == []
            rows = api.get("/api/artifacts?kind=source-file")
            assert rows.status_code in (200, 404, 405) and "id_rsa" not in rows.text


def test_gc_and_pins_are_for_admin_tokens_and_leave_the_records(api: Api) -> None:
    detail = api.submit_and_wait()
    job_id = detail["id"]
    outputs = {o["name"]: o["sha256"] for stage in detail["stages"][:2] for o in stage["outputs"]}
    manifest, config = outputs["manifest.json"], outputs["config.json"]
    assert api.post("/api/store/gc", {}).status_code == 403
    assert api.post(f"/api/artifacts/{manifest}/pin", token=SUBMIT_TOKEN).status_code == 403

    kept = api.post("/api/store/gc", {"dry_run": True}, token=ADMIN_TOKEN).json()
    assert kept["removed"] == 0 and kept["kept"]["unfinished job"] == len(outputs), "a failed job can retry"
    assert api.post(f"/api/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert api.post(f"/api/artifacts/{manifest[:12]}/pin", token=ADMIN_TOKEN).json()["pinned"]
    assert api.post("/api/store/gc", {"older_than": "soon"}, token=ADMIN_TOKEN).status_code == 400

    done = api.post("/api/store/gc", {}, token=ADMIN_TOKEN).json()
    assert set(done["removed_sha256"]) == set(outputs.values()) - {manifest} and done["kept"]["pinned"] == 1
    record = api.get(f"/api/artifacts/{config}").json()
    assert record["released_at"] is not None and record["links"], "the record and its links stay"
    gone = api.get(f"/api/artifacts/{config}/download")
    assert gone.status_code == 410 and "bytes not retained" in gone.text
    chain = api.get(f"/api/artifacts/{manifest}/chain?verify=true").json()
    assert chain["ok"] and chain["not_retained"] == 2, chain
    assert [p["reason"] for p in api.get(f"/api/artifacts/{manifest}").json()["pins"]] == ["pin"]
    # Every one of those changes is one row of the account, with its actor and outcome.
    unpinned = api.client.delete(f"/api/artifacts/{manifest}/pin",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert unpinned.status_code == 200 and unpinned.json()["was_pinned"]
    account = api.get(f"/api/history?job={job_id}").json()
    assert [(row["action"], row["actor"]) for row in account] == [("submit", "api:ci"), ("cancel", "api:ci")]
    assert all(row["team"] == row["actor"] and row["outcome"] == "ok" for row in account)
    store_rows = api.get("/api/history?actor=api:ops").json()
    assert [row["action"] for row in store_rows] == ["pin", "gc", "unpin"], "a dry run changes nothing"
    gc_row = store_rows[1]
    assert gc_row["target"] == "store" and gc_row["detail"]["removed_bytes"] == done["removed_bytes"] > 0
    assert api.get("/api/history?action=pin").json()[0]["target"] == manifest
    assert api.get("/api/history?since=2999-01-01").json() == []
    assert api.get("/api/history?action=delete").status_code == 400
    assert api.get(f"/api/history?job={2**63}").status_code == 422, "an id past the column's range"
    for edge in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):
        assert api.get(f"/api/history?since={edge.replace('+', '%2B')}").status_code == 200, edge
    assert "not a time" in api.get("/api/history?since=yesterday").json()["detail"]
    assert api.get("/api/history").status_code == 200 and api.client.get("/api/history").status_code == 401
