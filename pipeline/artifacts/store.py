"""The artifact store interface: bytes in, addressed by their sha256, never changed.

Keys are lowercase hex sha256 digests. `put` hashes the bytes it stores and refuses
them when they do not match the digest the caller expected; storing bytes that are
already present is a no-op that returns the existing entry.
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.core.errors import InputError

__all__ = ["ArtifactStore", "StoredArtifact", "check_digest", "put_all", "LOCAL_URI_PREFIX", "shareable_uri"]

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class StoredArtifact:
    sha256: str
    size_bytes: int
    uri: str


class ArtifactStore(Protocol):
    def put(self, source: Path, expected_sha256: str | None = None) -> StoredArtifact:
        """Store the file at `source`; raise IntegrityError if it does not hash to `expected_sha256`.

        The source file is left in place. Concurrent puts of the same bytes are safe. What put
        returns is durable (flushed to disk, or held by the bucket), so stages write their work
        files without flushing them.
        """
        ...

    def has(self, sha256: str) -> bool:
        """Whether bytes with this digest are stored."""
        ...

    def path(self, sha256: str) -> Path:
        """A local, read-only path to the stored bytes; KeyError when absent."""
        ...

    def verify(self, sha256: str) -> bool:
        """Re-hash the stored bytes; True when they still match their key."""
        ...

    def rehash(self, sha256: str) -> tuple[str, int]:
        """Re-read the stored bytes (the store's own copy, never a cache): their sha256 and size.

        KeyError when absent. Audits use it: it finds damage that `path()` would refuse.
        """
        ...

    def local_path(self, sha256: str) -> Path | None:
        """A path to the bytes when they are on this machine already (nothing fetched); None otherwise."""
        ...

    def uri(self, sha256: str) -> str:
        """The URI recorded in the database for this digest."""
        ...

    def remove(self, sha256: str) -> int:
        """Delete the stored bytes (`bonsai gc` alone calls it): the bytes freed, 0 when absent."""
        ...


def put_all(store: ArtifactStore, files: Sequence[tuple[Path, str | None]]) -> list[StoredArtifact]:
    """`store.put(path, expected_sha256)` for every file, in parallel across cores; results in order.

    Puts hash what they store and hashlib releases the GIL, so threads use every core. The
    first IntegrityError (or OSError) raised by any put is raised here.
    """
    workers = min(len(files), os.cpu_count() or 1)
    if workers <= 1:
        return [store.put(path, expected) for path, expected in files]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="put") as pool:
        # Each put runs in a copy of this context, so it counts into the attempt's store activity.
        futures = [pool.submit(_in_context(contextvars.copy_context(), store, path, expected))
                   for path, expected in files]
        return [future.result() for future in futures]


def _in_context(
    context: contextvars.Context, store: ArtifactStore, path: Path, expected: str | None
) -> Callable[[], StoredArtifact]:
    return lambda: context.run(store.put, path, expected)


# How a local store names an artifact in URIs (provenance, bundles, the API): its kind and the digest.
LOCAL_URI_PREFIX = "local:sha256/"


def shareable_uri(uri: str, sha256: str) -> str:
    """``uri`` as API answers and bundles may carry it: a ``file://`` path (recorded before local URIs
    named the store) becomes the store's name and the digest; other URIs are kept."""
    return f"{LOCAL_URI_PREFIX}{check_digest(sha256)}" if uri.startswith("file:") else uri


def check_digest(sha256: str) -> str:
    """Return `sha256` when it is a well-formed key; InputError otherwise (blocks path tricks)."""
    if not _DIGEST.match(sha256):
        raise InputError(f"{sha256!r} is not a sha256 digest (64 lowercase hex characters)")
    return sha256
