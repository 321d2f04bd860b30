"""Every setting in one frozen object, read from `BONSAI_*` variables at the edge.

Only entry points (cli.py, api.py, workers/celery_app.py) call `Settings.from_env()`;
everything else receives a Settings instance. With nothing set, the embedded default
applies: a SQLite file and an artifact store under `BONSAI_HOME` (default
``./.bonsai``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.core.errors import InputError

__all__ = ["Settings"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BONSAI_", frozen=True, extra="ignore")

    # Data folder of the embedded mode: SQLite file, artifact store, work folders.
    home: Path = Field(default=Path(".bonsai"))
    # SQLAlchemy URL; empty means SQLite at <home>/bonsai.db.
    database_url: str = ""
    # Celery broker; empty means stages run in-process (embedded mode).
    broker_url: str = ""
    # Root of the content-addressed artifact store: a folder, or s3://bucket/prefix for an S3-compatible
    # object store (credentials and region from the standard AWS_* variables); empty means <home>/artifacts.
    artifact_root: str | None = None
    # Endpoint of that object store (SeaweedFS, MinIO, Ceph); empty means AWS_ENDPOINT_URL or AWS itself.
    s3_endpoint_url: str | None = None
    # Files larger than this go up to the object store in parts of this size (at least 5 MiB).
    s3_part_size_bytes: int = 64 * 1024 * 1024
    # Worker-local read-through cache of an s3:// store; empty means <home>/cache.
    cache_root: Path | None = None
    # Bound of that cache; least recently used entries go first (one larger artifact is still kept).
    cache_max_bytes: int = 50 * 1024**3
    # Where `bonsai convert` copies the GGUF (as <model>-<TYPE>.gguf) when --out is not given;
    # empty means the current folder.
    output_dir: Path | None = None
    # Where stages get their scratch folders; empty means <home>/work.
    work_root: Path | None = None
    # Attempts of one stage before the job fails for good (worker lost, retryable errors).
    max_attempts: int = 3
    # Embedded mode: stages of one job whose inputs are ready run side by side, up to this many
    # (calibrate's llama.cpp child beside package, for instance); 1 runs them one at a time.
    stage_threads: int = 2
    # A worker's cap on one stage attempt's memory, in MB (0: none). An attempt past it is recorded
    # as "out of memory" and stopped; the job fails once the attempt limit is reached.
    worker_memory_mb: int = 0
    # Seconds between heartbeats of a running stage.
    heartbeat_s: float = 10.0
    # Seconds without a heartbeat after which a running stage counts as lost.
    heartbeat_timeout_s: float = 120.0
    # First retry delay for retryable failures; doubles with each attempt.
    retry_base_s: float = 5.0
    # A queued stage whose message the broker does not hold is re-sent after this many seconds.
    requeue_after_s: float = 60.0
    # Distributed mode: decompose a model of several shards on several workers at once.
    fanout: bool = True
    # Threads each worker process gives numba (the ternary kernel) and torch; 0 leaves their default
    # (every core), except that `bonsai worker --concurrency N` shares the cores among its N children.
    worker_threads: int = 0
    # The name the in-toto statements give this worker as their builder; empty means the host's name.
    worker_name: str = ""
    # TOML file of team policies (weights, caps, quotas; see `core.teams`); empty: the defaults for all.
    teams_file: Path | None = None
    # The team the CLI submits as; empty means the CLI user's own team (cli:USER).
    team: str = ""
    # Package holding the stage modules; only benchmarks change it (to no-op stages).
    stage_package: str = "pipeline.stages"
    # Hugging Face token, passed to the hub client only; never stored or logged.
    hf_token: str | None = Field(default=None, repr=False)
    # HTTP API bearer tokens, comma-separated "name:scopes:sha256hex" (scopes read, submit, joined by "+");
    # only the tokens' sha256 hashes are configured. `bonsai api-token NAME` makes an entry.
    api_tokens: str = Field(default="", repr=False)
    # Requests each API token may make per window, e.g. "120/minute" (`limits` notation); empty: no limit.
    api_rate_limit: str = ""
    # Folders local sources must resolve into (os.pathsep- or comma-separated). Empty: the API
    # accepts hub ids only, and the CLI any path its user can read.
    source_roots: str = ""
    # Where the API may publish bundles: folders (os.pathsep- or comma-separated) and s3://bucket/prefix
    # locations (comma-separated). Neither set: the API refuses publish (the CLI writes where its user can).
    publish_roots: str = ""
    publish_buckets: str = ""
    # Hub repos the server's Hugging Face token is sent for: orgs ("acme") or repo globs ("acme/llama-*"),
    # comma-separated. Every other hub source is fetched anonymously.
    hub_token_repos: str = ""
    # Ed25519 private key (PEM) that signs provenance statements; unset means statements stay unsigned.
    signing_key: Path | None = None
    # Ed25519 public key (PEM) that `bonsai audit` checks signatures with; unset means the signing key's.
    signing_public_key: Path | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Read `BONSAI_*` variables; explicit overrides (CLI options) win when not None."""
        return cls(**{key: value for key, value in overrides.items() if value is not None})

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'bonsai.db').resolve()}"

    @property
    def is_object_store(self) -> bool:
        """Whether artifacts live in an S3-compatible bucket (`BONSAI_ARTIFACT_ROOT=s3://…`)."""
        return (self.artifact_root or "").startswith("s3://")

    @property
    def resolved_artifact_root(self) -> Path:
        """The local store's folder; InputError for an s3:// root (use `artifact_location`)."""
        if self.is_object_store:
            raise InputError(f"artifact root {self.artifact_root} is a bucket, not a folder")
        return (Path(self.artifact_root) if self.artifact_root else self.home / "artifacts").resolve()

    @property
    def artifact_location(self) -> str:
        """The s3:// URL, or the local store's absolute folder."""
        return str(self.artifact_root) if self.is_object_store else str(self.resolved_artifact_root)

    @property
    def resolved_cache_root(self) -> Path:
        return (self.cache_root or self.home / "cache").resolve()

    @property
    def resolved_work_root(self) -> Path:
        return (self.work_root or self.home / "work").resolve()

    @property
    def source_root_list(self) -> tuple[str, ...]:
        """`source_roots` split into folder names."""
        return _items(self.source_roots, folders=True)

    @property
    def publish_root_list(self) -> tuple[str, ...]:
        """`publish_roots` split into folder names."""
        return _items(self.publish_roots, folders=True)

    @property
    def publish_bucket_list(self) -> tuple[str, ...]:
        """`publish_buckets` split into s3:// locations."""
        return _items(self.publish_buckets)

    @property
    def hub_token_repo_list(self) -> tuple[str, ...]:
        """`hub_token_repos` split into orgs and repo globs."""
        return _items(self.hub_token_repos)

    @property
    def is_embedded(self) -> bool:
        return not self.broker_url

    def validate_all(self) -> Settings:
        """Check values a process cannot run without; returns self for chaining."""
        if self.worker_memory_mb < 0:
            raise InputError(
                f"BONSAI_WORKER_MEMORY_MB must be 0 (no cap) or more, got {self.worker_memory_mb}"
            )
        if self.max_attempts < 1:
            raise InputError(f"BONSAI_MAX_ATTEMPTS must be at least 1, got {self.max_attempts}")
        if not 1 <= self.stage_threads <= 16:
            raise InputError(f"BONSAI_STAGE_THREADS must be from 1 to 16, got {self.stage_threads}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_s:
            raise InputError(
                f"BONSAI_HEARTBEAT_TIMEOUT_S ({self.heartbeat_timeout_s}) must exceed twice "
                f"BONSAI_HEARTBEAT_S ({self.heartbeat_s}), or live stages would be declared lost"
            )
        if self.heartbeat_timeout_s <= 0:
            raise InputError(
                f"BONSAI_HEARTBEAT_TIMEOUT_S must be positive, got {self.heartbeat_timeout_s}"
            )
        if self.worker_threads < 0:
            raise InputError(
                f"BONSAI_WORKER_THREADS must be 0 (libraries' default) or a thread count, "
                f"got {self.worker_threads}"
            )
        scheme = self.resolved_database_url.split(":", 1)[0]
        if not scheme.startswith(("sqlite", "postgresql")):
            raise InputError(
                f"BONSAI_DATABASE_URL scheme {scheme!r} is not supported; use sqlite:/// or postgresql+psycopg://"
            )
        return self


def _items(text: str, *, folders: bool = False) -> tuple[str, ...]:
    """A comma-separated setting's items, stripped, empty ones dropped; a folder list may also be
    separated by os.pathsep (as PATH is)."""
    parts = text.replace(",", os.pathsep).split(os.pathsep) if folders else text.split(",")
    return tuple(part.strip() for part in parts if part.strip())
