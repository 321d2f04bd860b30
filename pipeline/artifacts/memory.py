"""In-memory artifact store for unit tests; same contract as LocalStore."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from pipeline.artifacts.store import StoredArtifact, check_digest
from pipeline.core.errors import IntegrityError

__all__ = ["MemoryStore"]


class MemoryStore:
    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._spill = Path(tempfile.mkdtemp(prefix="bonsai-memstore-"))

    def put(self, source: Path, expected_sha256: str | None = None) -> StoredArtifact:
        data = Path(source).read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        if expected_sha256 is not None and sha256 != expected_sha256:
            raise IntegrityError(
                f"{source}: stored bytes hash to {sha256}, expected {expected_sha256}; not stored"
            )
        self._blobs.setdefault(sha256, data)
        return StoredArtifact(sha256, len(data), self.uri(sha256))

    def has(self, sha256: str) -> bool:
        return check_digest(sha256) in self._blobs

    def path(self, sha256: str) -> Path:
        if not self.has(sha256):
            raise KeyError(f"artifact {sha256} is not in the memory store")
        spilled = self._spill / sha256
        if not spilled.exists():
            spilled.write_bytes(self._blobs[sha256])
        return spilled

    def verify(self, sha256: str) -> bool:
        return self.rehash(sha256)[0] == sha256

    def rehash(self, sha256: str) -> tuple[str, int]:
        data = self._blobs[check_digest(sha256)]
        return hashlib.sha256(data).hexdigest(), len(data)

    def local_path(self, sha256: str) -> Path | None:
        return self.path(sha256) if self.has(sha256) else None

    def uri(self, sha256: str) -> str:
        return f"memory://{check_digest(sha256)}"

    def remove(self, sha256: str) -> int:
        (self._spill / check_digest(sha256)).unlink(missing_ok=True)
        return len(self._blobs.pop(sha256, b""))
