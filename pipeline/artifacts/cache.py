"""A worker's read-through cache of stored artifacts: <root>/sha256/ab/<digest>, bounded, LRU out.

Entries are written to a temporary name and renamed only after their bytes hashed to the
digest they are filed under, and they are read-only from then on; so a hit is handed
out without re-reading it. Recency is the file's mtime, refreshed on every hit.

Eviction must not pull a file from under a stage of this or another process on the same
machine: every entry handed out inside a `store_activity()` window is held open with a
shared `flock`, and the evictor removes only entries it can lock exclusively. A reader
re-checks after locking that the name still points at the inode it locked, so an entry
removed between its `open` and its lock counts as a miss.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from pipeline.artifacts.activity import current_activity
from pipeline.artifacts.store import check_digest
from pipeline.core.errors import IntegrityError
from pipeline.core.files import commit_file

__all__ = ["LocalCache"]

_COPY_CHUNK_BYTES = 8 * 1024 * 1024
# Temporary files older than this belong to a process that died mid-fill.
_STALE_TMP_S = 6 * 3600


class LocalCache:
    """At most about `max_bytes` of artifacts under `root` (one entry larger than that is still kept)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        (self.root / "sha256").mkdir(exist_ok=True)
        self._clear_stale_tmp()

    def entry_path(self, sha256: str) -> Path:
        check_digest(sha256)
        return self.root / "sha256" / sha256[:2] / sha256

    def lookup(self, sha256: str) -> Path | None:
        """The cached file (pinned while a window is open, recency refreshed), or None on a miss."""
        path = self.entry_path(sha256)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            is_current = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            is_current = False
        if not is_current:
            os.close(fd)
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # another user's entry: recency is a hint, the bytes are what matter
        self._hold(fd)
        return path

    def fill(self, sha256: str, chunks: Iterable[bytes], what: str) -> Path:
        """Write `chunks` as the entry for `sha256`; IntegrityError (nothing cached) when they hash otherwise.

        `what` names the origin (an s3:// URI) in the error message.
        """
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", prefix="fill-")
        tmp = Path(tmp_name)
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as handle:
                for chunk in chunks:
                    digest.update(chunk)
                    handle.write(chunk)
                    size += len(chunk)
            if digest.hexdigest() != sha256:
                raise IntegrityError(
                    f"{what}: the {size:,} bytes read hash to sha256 {digest.hexdigest()}, expected {sha256} "
                    "(the stored object is damaged); nothing was cached. Run `bonsai audit` on it and "
                    "rerun the stage that wrote it with `bonsai retry JOB --from STAGE --force`"
                )
            return self._install(tmp, sha256)
        finally:
            tmp.unlink(missing_ok=True)

    def adopt(self, source: Path, sha256: str) -> Path:
        """Enter a file already hashed to `sha256` (a stage's output); hard-linked when it has one name."""
        final = self.entry_path(sha256)
        if final.exists():
            return self.lookup(sha256) or self.adopt(source, sha256)
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", prefix="adopt-")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            stat = os.stat(source)
            if stat.st_nlink == 1 and stat.st_dev == os.stat(self.root).st_dev:
                tmp.unlink()
                os.link(source, tmp)
            else:
                # A file with other names (a user's folder) is copied and re-hashed on the way.
                with open(source, "rb") as src:
                    return self.fill(sha256, iter(lambda: src.read(_COPY_CHUNK_BYTES), b""), str(source))
            return self._install(tmp, sha256)
        finally:
            tmp.unlink(missing_ok=True)

    def _install(self, tmp: Path, sha256: str) -> Path:
        final = self.entry_path(sha256)
        final.parent.mkdir(parents=True, exist_ok=True)
        if not final.exists():
            os.chmod(tmp, 0o444)
            # A hit is handed out without re-hashing, so the bytes must be on disk before the name
            # is: neither a download nor a stage's work file (stages do not flush) is yet.
            commit_file(tmp, final)
        path = self.lookup(sha256)
        self.evict(keep=final)
        return path or final

    def discard(self, sha256: str) -> None:
        """Drop the entry unless a stage on this machine holds it (it goes with the next eviction then)."""
        _remove_unheld(self.entry_path(sha256))

    def _hold(self, fd: int) -> None:
        activity = current_activity()
        if activity is None:
            os.close(fd)
        else:
            activity.pinned_fds.append(fd)

    def size_bytes(self) -> int:
        """Bytes the entries take now."""
        return sum(size for _mtime, size, _path in self._entries())

    def _entries(self) -> list[tuple[float, int, Path]]:
        found = []
        for bucket in os.scandir(self.root / "sha256"):
            if not bucket.is_dir():
                continue
            for entry in os.scandir(bucket.path):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue  # evicted by another process while we looked
                found.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return found

    def evict(self, keep: Path | None = None) -> int:
        """Drop LRU unpinned entries (not `keep`) until the cache fits; returns the bytes freed."""
        entries = sorted(self._entries())
        total = sum(size for _mtime, size, _path in entries)
        freed = 0
        for _mtime, size, path in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            removed = _remove_unheld(path)
            if removed is None:
                continue  # a stage on this machine holds it
            total -= size
            freed += size if removed else 0
        return freed

    def _clear_stale_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        for leftover in (self.root / "tmp").iterdir():
            try:
                if leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            except FileNotFoundError:
                continue


def _remove_unheld(path: Path) -> bool | None:
    """Unlink the entry unless someone holds it: True if removed, False if already gone, None if held."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True
