"""The API fuzzed from its own OpenAPI schema with schemathesis (issue 24, deliver 8): every operation,
inputs that fit the schema and inputs that do not, under a read and a submit token. No answer may be
a server error, and none may carry a secret planted in the server's environment.

Bounded here (``BONSAI_FUZZ_API_EXAMPLES`` per operation and mode, default 15); a long run sets it
higher. The server is embedded on SQLite, offline, with source roots that hold a real checkpoint
folder, so submitted jobs run and fail at once in the background.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pipeline.app.api.app import create_app
from pipeline.app.api.auth import new_token
from pipeline.core.settings import Settings

SECRET = "planted-secret-schema-93d1"
READ, READ_ENTRY = new_token("reader", ("read",))
SUBMIT, SUBMIT_ENTRY = new_token("alice", ("submit",))
EXAMPLES = int(os.environ.get("BONSAI_FUZZ_API_EXAMPLES", "15"))


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from huggingface_hub import constants

    root = tmp_path_factory.mktemp("schema-fuzz")
    (root / "models" / "ckpt").mkdir(parents=True)
    (root / "models" / "ckpt" / "config.json").write_text('{"model_type": "llama"}\n')
    saved = {key: os.environ.get(key) for key in ("AWS_SECRET_ACCESS_KEY", "HF_HUB_OFFLINE")}
    os.environ.update(AWS_SECRET_ACCESS_KEY=SECRET, HF_HUB_OFFLINE="1")
    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    settings_ = Settings(home=root / "home", source_roots=str(root / "models"),
                         api_tokens=f"{READ_ENTRY},{SUBMIT_ENTRY}", hf_token=f"hf_{SECRET}")
    application = create_app(settings_)
    try:
        with TestClient(application) as client:
            # One real job, so that job routes meet an existing id too.
            created = client.post("/api/jobs", json={"source": str(root / "models" / "ckpt")},
                                  headers={"Authorization": f"Bearer {SUBMIT}"})
            assert created.status_code == 201, created.text
            yield application
    finally:
        constants.HF_HUB_OFFLINE = offline
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _operations(app: Any) -> list[Any]:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Authorization": f"Bearer {READ}"})
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_operation_answers_5xx_or_leaks(app: Any, mode: GenerationMode) -> None:
    operations = _operations(app)
    assert len(operations) >= 8
    failures: list[str] = []
    calls: list[int] = []
    for operation in operations:
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode), token=st.sampled_from([READ, SUBMIT]))
        def probe(case: Any, token: str) -> None:
            response = case.call(headers={"Authorization": f"Bearer {token}"})
            calls.append(response.status_code)
            if response.status_code >= 500 or SECRET in response.text:
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                f"{response.text[:200]}")

        probe()
    print(f"schema fuzz {mode.value}: {len(calls)} requests over {len(operations)} operations, "
          f"{sum(code >= 500 for code in calls)} server errors")
    assert not failures, failures[:10]


def test_the_schema_is_fuzzed_with_both_tokens_reaching_the_routes(app: Any) -> None:
    labels = {f"{op.method.upper()} {op.path}" for op in _operations(app)}
    assert {"POST /api/jobs", "GET /api/jobs", "POST /api/jobs/{job_id}/publish",
            "POST /api/jobs/{job_id}/cancel"} <= labels
