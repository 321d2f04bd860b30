"""docker-compose.yml: no Docker engine runs here, so check its shape and that its bonsai
commands parse with the real CLI (the same commands the integration tests run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from pipeline.app.cli import cli
from pipeline.orchestration.queues import QUEUES

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _parse(args: list[str]) -> click.Context:
    """Resolve a bonsai command line down to its leaf command, parsing every option."""
    group: click.Command = cli
    ctx = group.make_context("bonsai", list(args))
    while isinstance(group, click.Group):
        # Click 8 keeps the subcommand name in _protected_args, later versions in args.
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, command, remaining = group.resolve_command(ctx, rest)
        assert command is not None, f"unknown command {name!r} in {args}"
        ctx = command.make_context(name, remaining, parent=ctx)
        group = command
    return ctx


def test_expected_services(services: dict[str, Any]) -> None:
    assert {"postgres", "redis", "migrate", "worker-io", "worker-cpu", "worker-gpu", "flower",
            "reconciler"} <= set(services)


def test_every_bonsai_command_parses(services: dict[str, Any]) -> None:
    commands = [svc["command"] for svc in services.values() if svc.get("command", [""])[0] == "bonsai"]
    assert len(commands) >= 6
    for command in commands:
        _parse(command[1:])


def test_workers_cover_every_queue_and_gpu_reserves_a_device(services: dict[str, Any]) -> None:
    covered = set()
    for name, svc in services.items():
        if name.startswith("worker-"):
            ctx = _parse(svc["command"][1:])
            covered |= set(ctx.params["queues"].split(","))
    assert covered == set(QUEUES)
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_stateful_services_have_healthchecks_and_migrate_runs_first(services: dict[str, Any]) -> None:
    for name in ("postgres", "redis", "worker-io", "worker-cpu", "worker-gpu"):
        assert "healthcheck" in services[name], name
    assert services["migrate"]["command"] == ["bonsai", "db", "upgrade"]
    depends = services["worker-gpu"]["depends_on"]
    assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_a_bad_command_would_be_caught() -> None:
    with pytest.raises(click.UsageError):
        _parse(["worker", "--no-such-option"])


def test_workers_share_no_folder_and_keep_artifacts_in_the_bucket(services: dict[str, Any]) -> None:
    workers = {name: svc for name, svc in services.items() if name.startswith("worker-")}
    for name, svc in workers.items():
        assert svc["environment"]["BONSAI_ARTIFACT_ROOT"].startswith("s3://"), name
        assert svc["environment"]["BONSAI_S3_ENDPOINT_URL"] == "http://s3:8333", name
        assert svc["depends_on"]["s3"]["condition"] == "service_healthy", name
    mounted = [volume.split(":")[0] for svc in workers.values() for volume in svc.get("volumes", [])]
    assert len(mounted) == len(set(mounted)) == len(workers), f"each worker its own cache volume: {mounted}"
    assert "healthcheck" in services["s3"]


def test_flower_loads_the_worker_app_with_task_events(services: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    command = services["flower"]["command"]
    module = command[command.index("-A") + 1]
    monkeypatch.setenv("BONSAI_BROKER_URL", "redis://127.0.0.1:6379/0")
    app = importlib.import_module(module).app  # what `celery -A module` finds; no broker is contacted
    assert app.conf.worker_send_task_events and app.conf.task_send_sent_event
    assert app.backend.get_state("any-task-id") == "PENDING"  # a revoke's state lookup does not raise


def test_flower_needs_a_password_and_listens_on_loopback(services: dict[str, Any]) -> None:
    flower = services["flower"]
    assert any(arg.startswith("--basic-auth=${FLOWER_BASIC_AUTH:?") for arg in flower["command"])
    assert all(str(port).startswith("127.0.0.1:") for port in flower["ports"])
