"""Real services for integration tests: a fresh PostgreSQL database per test, real Redis.

Locally a missing service skips these tests with the reason; under CI (CI=true) a
missing service fails them, because the README's test command starts the services.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

PG_URL = os.environ.get("BONSAI_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("BONSAI_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _unavailable(what: str, exc: Exception) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is required under CI and could not be reached: {exc}")
    pytest.skip(f"{what} not reachable ({exc}); run `make services` or `make test`")


def _admin_conninfo() -> str:
    return PG_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """URL of a new, empty PostgreSQL database, dropped after the test."""
    import psycopg

    name = f"bonsai_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(_admin_conninfo(), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        _unavailable("PostgreSQL", exc)
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = PG_URL.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(_admin_conninfo(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        _unavailable("Redis", exc)
    return REDIS_URL


@pytest.fixture
def broker_url(redis_url: str) -> Iterator[str]:
    """A Redis database of its own (index 11, or BONSAI_TEST_REDIS_DB) on the shared server, emptied
    before and after. Two test runs on one machine at once need different indexes."""
    import redis

    url = redis_url.rsplit("/", 1)[0] + "/" + os.environ.get("BONSAI_TEST_REDIS_DB", "11")
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
