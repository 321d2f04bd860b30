"""A hub that cannot be reached: one clear error naming the fix, no retry storm, the cache still used.

The hub endpoint is a loopback port nothing listens on (connection refused at once), so nothing
here leaves the machine, and the real HfHubClient and huggingface_hub code paths run.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.clients.hub import HfHubClient
from pipeline.core.errors import TransientError, UnreachableError
from pipeline.core.settings import Settings
from pipeline.core.states import JobState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.runtime import Runtime
from pipeline.stages import download
from pipeline.stages.base import StageClients
from tests.support.hub_cache import COMMIT, REPO, build_hub_cache


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again when the block ends: nothing listens there


@pytest.fixture()
def closed_hub(monkeypatch: pytest.MonkeyPatch) -> str:
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return endpoint


def test_unreachable_hub_without_cache_names_every_fix(tmp_path: Path, closed_hub: str) -> None:
    hub = HfHubClient(cache_dir=tmp_path / "cache")
    with pytest.raises(UnreachableError) as caught:
        hub.resolve_revision("Qwen/Qwen2.5-0.5B", None)
    message = str(caught.value)
    assert closed_hub in message and "Connection refused" in message
    assert "hf download Qwen/Qwen2.5-0.5B" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert "local folder" in message and str(tmp_path / "cache") in message
    assert not caught.value.is_retryable
    assert "\n" not in message and len(message) < 500


def test_unknown_host_is_unreachable_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://hub.invalid")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(UnreachableError, match="hub.invalid cannot be reached"):
        HfHubClient(cache_dir=tmp_path).resolve_revision("acme/model", "main")


def test_a_timeout_stays_transient(tmp_path: Path) -> None:
    hub = HfHubClient(cache_dir=tmp_path, is_offline=False)
    with pytest.raises(TransientError), hub._translate(REPO, "main"):
        raise TimeoutError("read timed out")


def test_unreachable_hub_with_a_cached_copy_downloads_from_the_cache(tmp_path: Path, closed_hub: str) -> None:
    cache = tmp_path / "cache"
    weights = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights}
    build_hub_cache(cache, files)
    hub = HfHubClient(cache_dir=cache)
    work = tmp_path / "work"
    work.mkdir()
    result = download.run(download.Params(REPO), {}, work, StageClients(hub=hub))
    assert result.metrics["resolved_revision"] == COMMIT
    assert result.metrics["hub_sha256_count"] == 1  # the cached listing of the commit, not an empty one
    assert (work / "snapshot" / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_job_fails_once_with_the_fix_not_three_times(tmp_path: Path, closed_hub: str) -> None:
    base = build_runtime(Settings(home=tmp_path / "home", retry_base_s=0.01, max_attempts=3))
    rt = Runtime(**{**base.__dict__, "clients": StageClients(hub=HfHubClient(cache_dir=tmp_path / "cache"))})
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, "Qwen/Qwen2.5-0.5B", "tq2_0").id
    assert run_job(rt, job_id) is JobState.FAILED
    with session_scope(rt.sessions) as session:
        runs = list(session.scalars(select(StageRun).where(StageRun.job_id == job_id)))
        assert [(r.stage, r.attempt, r.error_kind) for r in runs] == [("download", 1, "permanent")]
        assert "UnreachableError" in runs[0].error_message
        job = repo.get_job(session, job_id)
        assert "after 3 attempts" not in job.error_message and "HF_HUB_OFFLINE=1" in job.error_message
