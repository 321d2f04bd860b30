"""Artifact store on a local (or shared network) folder: <root>/sha256/ab/abcdef…"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.artifacts.store import StoredArtifact, check_digest
from pipeline.core.errors import IntegrityError
from pipeline.core.files import commit_file

__all__ = ["LocalStore"]

_COPY_CHUNK_BYTES = 8 * 1024 * 1024


class LocalStore:
    """Files live under `root`; each is written (or hard-linked) to a temporary name, then renamed.

    A work-folder file that has no other name is hard-linked rather than copied: stages
    write their outputs on the same disk, and a multi-GB model should not be copied twice.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def _final_path(self, sha256: str) -> Path:
        check_digest(sha256)
        return self.root / "sha256" / sha256[:2] / sha256

    def put(self, source: Path, expected_sha256: str | None = None) -> StoredArtifact:
        if expected_sha256 is not None and self.has(expected_sha256):
            final = self._final_path(expected_sha256)
            return StoredArtifact(expected_sha256, final.stat().st_size, final.as_uri())
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", prefix="put-")
        tmp = Path(tmp_name)
        try:
            if self._can_link(source):
                os.close(fd)
                sha256, size = self._link_and_hash(source, tmp)
            else:
                sha256, size = self._copy_and_hash(source, fd)
            if expected_sha256 is not None and sha256 != expected_sha256:
                raise IntegrityError(
                    f"{source}: stored bytes hash to {sha256}, expected {expected_sha256}; not stored"
                )
            final = self._final_path(sha256)
            final.parent.mkdir(parents=True, exist_ok=True)
            if not final.exists():
                os.chmod(tmp, 0o444)
                commit_file(tmp, final, exclusive=True)  # equal bytes under an equal key: keep the first
            return StoredArtifact(sha256, size, final.as_uri())
        finally:
            tmp.unlink(missing_ok=True)

    def _can_link(self, source: Path) -> bool:
        # A file with other names (a user's folder linked into a work folder) is copied, so
        # nothing the user later does to it can change stored bytes, and vice versa.
        stat = os.stat(source)
        return stat.st_nlink == 1 and stat.st_dev == os.stat(self.root).st_dev

    @staticmethod
    def _link_and_hash(source: Path, tmp: Path) -> tuple[str, int]:
        tmp.unlink()
        os.link(source, tmp)
        with open(tmp, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256")
        return digest.hexdigest(), tmp.stat().st_size

    @staticmethod
    def _copy_and_hash(source: Path, fd: int) -> tuple[str, int]:
        digest = hashlib.sha256()
        size = 0
        with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
            # Hash while copying: one read of the bytes proves what was stored.
            while chunk := src.read(_COPY_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        return digest.hexdigest(), size

    def has(self, sha256: str) -> bool:
        return self._final_path(sha256).is_file()

    def path(self, sha256: str) -> Path:
        final = self._final_path(sha256)
        if not final.is_file():
            raise KeyError(f"artifact {sha256} is not in the store at {self.root}")
        return final

    def verify(self, sha256: str) -> bool:
        return self.rehash(sha256)[0] == sha256

    def rehash(self, sha256: str) -> tuple[str, int]:
        with open(self.path(sha256), "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest(), handle.tell()

    def local_path(self, sha256: str) -> Path | None:
        final = self._final_path(sha256)
        return final if final.is_file() else None

    def uri(self, sha256: str) -> str:
        return self._final_path(sha256).as_uri()

    def remove_tmp(self) -> int:
        """Delete leftovers of interrupted puts; returns how many were removed."""
        count = 0
        for leftover in (self.root / "tmp").iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            count += 1
        return count
