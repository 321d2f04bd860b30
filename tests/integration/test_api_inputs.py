"""POST /api/jobs checks a job's inputs as the CLI does (stages.options via job_control.check_request):
the same spellings accepted, the same refusals (400, nothing recorded), the same target warnings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeline.app.api.app import create_app
from pipeline.app.api.auth import new_token
from pipeline.core.settings import Settings
from pipeline.orchestration.bootstrap import build_runtime, migrate_database

pytestmark = pytest.mark.services

TOKEN, ENTRY = new_token("ci", ("submit",))
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(pg_url: str, tmp_path: Path) -> Iterator[TestClient]:
    source = tmp_path / "checkpoint"  # runs download and checksum, then stops at inspect (no weights)
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    settings = Settings(home=tmp_path / "home", database_url=pg_url, api_tokens=ENTRY,
                        source_roots=str(tmp_path))
    migrate_database(settings)
    with TestClient(create_app(settings, build_runtime(settings))) as test_client:
        yield test_client


def _submit(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/api/jobs", json=body, headers=HEADERS)


@pytest.mark.parametrize(("body", "message"), [
    ({"recipe": "tq9"}, "unknown recipe 'tq9'; did you mean 'tq2_0' or 'tq1_0'?"),
    ({"options": {"metod": "absmean"}}, "unknown option 'metod'; did you mean 'method'?"),
    ({"options": {"embed_type": "q4_k"}},
     "option embed_type='q4_k'; expected one of source, F16, BF16, F32, Q8_0"),
    ({"options": {"levels": 4}}, "levels=4 applies to recipe q2_0 only"),
    ({"target": "tpu"}, "option target='tpu'; expected one of cpu, cuda, metal, vulkan"),
    ({"options": {"agreement_pass_top1": 0.2}}, "agreement_fail_top1"),
])
def test_bad_inputs_are_400_and_record_nothing(client: TestClient, body: dict[str, Any], message: str,
                                               tmp_path: Path) -> None:
    response = _submit(client, {"source": str(tmp_path / "checkpoint"), **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["detail"]
    assert client.get("/api/jobs", headers=HEADERS).json() == []


def test_spellings_are_normalised_and_target_picks_and_warns(client: TestClient, tmp_path: Path) -> None:
    source = str(tmp_path / "checkpoint")
    first = _submit(client, {"source": source, "recipe": "TQ2_0",
                             "options": {"embed_type": "q8_0", "n_ctx": 512}, "target": "cuda"})
    assert first.status_code == 201, first.text
    (warning,) = first.json()["warnings"]
    assert warning.startswith("TQ2_0 has no kernel on cuda") and "'q2_0'" in warning
    second = _submit(client, {"source": source, "target": "cuda"})
    assert second.status_code == 201 and second.json()["warnings"] == []
    (job_a,), (job_b,) = first.json()["job_ids"], second.json()["job_ids"]
    a = client.get(f"/api/jobs/{job_a}", headers=HEADERS).json()
    assert (a["recipe"], a["params"], a["target"]) == ("tq2_0", {"embed_type": "Q8_0", "n_ctx": 512,
                                                                 "target": "cuda"}, "cuda")
    assert a["warnings"] == [warning]
    b = client.get(f"/api/jobs/{job_b}", headers=HEADERS).json()
    assert (b["recipe"], b["warnings"]) == ("q2_0", [])
