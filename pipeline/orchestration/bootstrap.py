"""Build the runtime (database, store, clients) a process needs, from Settings."""

from __future__ import annotations

import socket
from dataclasses import replace

from sqlalchemy import Engine

from pipeline.artifacts.local import LocalStore
from pipeline.artifacts.store import ArtifactStore
from pipeline.core.errors import InputError
from pipeline.core.settings import Settings
from pipeline.core.teams import load_teams
from pipeline.db import migrate
from pipeline.db.session import make_engine, make_sessionmaker
from pipeline.orchestration.distributed.dispatch import Dispatcher
from pipeline.orchestration.launcher import CeleryLauncher, EmbeddedLauncher
from pipeline.orchestration.runtime import Runtime
from pipeline.provenance.signing import load_private_key
from pipeline.stages.base import StageClients
from pipeline.stages.sources import SourcePolicy

__all__ = [
    "build_runtime", "build_store", "with_launcher", "migrate_database", "engine_for",
    "forget_engines_after_fork",
]


_ENGINES: dict[str, Engine] = {}


def engine_for(url: str) -> Engine:
    """One engine per URL per process."""
    if url not in _ENGINES:
        _ENGINES[url] = make_engine(url)
    return _ENGINES[url]


def forget_engines_after_fork() -> None:
    """In a forked child: drop the parent's pooled connections without closing its sockets."""
    for engine in _ENGINES.values():
        engine.dispose(close=False)
    _ENGINES.clear()


def migrate_database(settings: Settings) -> str:
    """Apply migrations; returns the URL with any password hidden."""
    settings.home.mkdir(parents=True, exist_ok=True)
    engine = engine_for(settings.resolved_database_url)
    migrate.upgrade(engine)
    return engine.url.render_as_string(hide_password=True)


def _require_current(engine: Engine) -> None:
    if migrate.is_current(engine):
        return
    shown = engine.url.render_as_string(hide_password=True)
    head = migrate.script_head() or "the newest migration"
    raise InputError(
        f"database {shown} is at revision {migrate.current_revision(engine) or 'none'}, code expects {head}; "
        "run `bonsai db upgrade` first"
    )


def build_store(settings: Settings) -> ArtifactStore:
    """The artifact store the settings name: a local folder, or a bucket with a local cache."""
    if not settings.is_object_store:
        return LocalStore(settings.resolved_artifact_root)
    from pipeline.artifacts.cache import LocalCache
    from pipeline.artifacts.s3 import S3Location, S3Store, make_s3_client

    return S3Store(
        S3Location.parse(settings.artifact_location),
        make_s3_client(settings.s3_endpoint_url),
        LocalCache(settings.resolved_cache_root, settings.cache_max_bytes),
        part_size_bytes=settings.s3_part_size_bytes,
    )


def build_runtime(settings: Settings) -> Runtime:
    """Everything a stage-running process holds. SQLite (embedded) migrates itself."""
    url = settings.resolved_database_url
    engine = engine_for(url)
    if url.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
        # A new file gets the current schema directly; an older one is migrated (Alembic loads only then).
        if not migrate.is_current(engine) and not migrate.create_current(engine):
            migrate_database(settings)
    else:
        _require_current(engine)
    from pipeline.clients.hub import HfHubClient

    rt = Runtime(
        sessions=make_sessionmaker(engine),
        store=build_store(settings),
        work_root=settings.resolved_work_root,
        # The download stage checks local sources against the allowed folders again when it runs.
        clients=StageClients(
            # The server's token goes only to the repos the operator lists; the rest are fetched anonymously.
            hub=HfHubClient(token=settings.hf_token, token_repos=settings.hub_token_repo_list),
            source_policy=SourcePolicy.from_roots(settings.source_root_list, allow_any_local=True),
        ),
        source_roots=settings.source_root_list,
        worker_name=settings.worker_name or socket.gethostname(),
        heartbeat_s=settings.heartbeat_s,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        max_attempts=settings.max_attempts,
        stage_threads=settings.stage_threads,
        retry_base_s=settings.retry_base_s,
        stage_package=settings.stage_package,
        signing_key=load_private_key(settings.signing_key) if settings.signing_key else None,
        teams=load_teams(settings.teams_file),
    )
    return with_launcher(rt, settings)


def with_launcher(rt: Runtime, settings: Settings) -> Runtime:
    """`rt` with the launcher `settings` call for: embedded without a broker, Celery with one."""
    if settings.is_embedded:
        return replace(rt, launcher=EmbeddedLauncher(rt, settings))
    dispatcher = Dispatcher(rt.sessions, settings)
    fanout = dispatcher.send_runs if settings.fanout else None
    return replace(rt, launcher=CeleryLauncher(dispatcher), fanout_dispatch=fanout)
