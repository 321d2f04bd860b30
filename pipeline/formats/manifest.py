"""The checksum manifest: every downloaded file's sha256 and size, and what they were verified against.

One dataclass, one `load` and one `write`. Its JSON shape (other tools read it)::

    {"files": [{"name": ..., "sha256": ..., "size_bytes": ...}, ...],
     "verified_against": ["SHA256SUMS", "hub_files.json"], "total_bytes": ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.files import write_json
from pipeline.formats.jsonfile import load_json

__all__ = ["MANIFEST_NAME", "FileDigest", "Manifest"]

MANIFEST_NAME = "manifest.json"
_MAX_BYTES = 64 * 1024 * 1024
_FIX = "retry the job from checksum"


@dataclass(frozen=True)
class FileDigest:
    """A file's content sha256 (hex) and size."""

    name: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    """The digests of a snapshot, sorted by name."""

    files: tuple[FileDigest, ...]
    verified_against: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def digests(self) -> dict[str, str]:
        return {f.name: f.sha256 for f in self.files}

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [{"name": d.name, "sha256": d.sha256, "size_bytes": d.size_bytes} for d in self.files],
            "verified_against": list(self.verified_against),
            "total_bytes": self.total_bytes,
        }

    def write(self, path: Path) -> str:
        """Write the manifest atomically at `path` and re-read it; returns the JSON text."""
        return write_json(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: Path, label: str = MANIFEST_NAME) -> Manifest:
        """Read and check a manifest; IntegrityError naming `label` when it is not one."""
        document = load_json(path, label, max_bytes=_MAX_BYTES, error=IntegrityError, fix=_FIX)
        entries = document.get("files") if isinstance(document, Mapping) else None
        if not isinstance(entries, list):
            raise IntegrityError(f"{label}: no 'files' list; {_FIX}")
        files = []
        for entry in entries:
            name = entry.get("name") if isinstance(entry, Mapping) else None
            sha256 = entry.get("sha256") if isinstance(entry, Mapping) else None
            size = entry.get("size_bytes") if isinstance(entry, Mapping) else None
            if not isinstance(name, str) or not isinstance(sha256, str) or not isinstance(size, int):
                raise IntegrityError(f"{label}: entry {entry!r} needs name, sha256 and size_bytes; {_FIX}")
            files.append(FileDigest(name, sha256.lower(), size))
        against = document.get("verified_against") or []
        if not isinstance(against, list) or not all(isinstance(a, str) for a in against):
            raise IntegrityError(f"{label}: verified_against must be a list of names; {_FIX}")
        return cls(tuple(files), tuple(against))
