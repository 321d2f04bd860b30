"""Artifact store on a local (or shared network) folder: <root>/sha256/ab/abcdef…"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from pipeline.artifacts.copying import copy_and_hash
from pipeline.artifacts.store import LOCAL_URI_PREFIX, StoredArtifact, check_digest
from pipeline.core.errors import IntegrityError
from pipeline.core.files import commit_file

__all__ = ["LocalStore"]

_WITNESS_LIMIT = 4096  # files remembered; a long-lived worker forgets the oldest


class LocalStore:
    """Files live under `root`; each is written (or hard-linked) to a temporary name, then renamed.

    A work-folder file that has no other name is hard-linked rather than copied: stages
    write their outputs on the same disk, and a multi-GB model should not be copied twice.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        # (st_dev, st_ino) -> (size, mtime_ns, ctime_ns, sha256) of files this store wrote and hashed.
        self._witnessed: OrderedDict[tuple[int, int], tuple[int, int, int, str]] = OrderedDict()
        self._witness_lock = threading.Lock()

    def _final_path(self, sha256: str) -> Path:
        check_digest(sha256)
        return self.root / "sha256" / sha256[:2] / sha256

    def put(self, source: Path, expected_sha256: str | None = None) -> StoredArtifact:
        if expected_sha256 is not None and self.has(expected_sha256):
            final = self._final_path(expected_sha256)
            return StoredArtifact(expected_sha256, final.stat().st_size, self.uri(expected_sha256))
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", prefix="put-")
        tmp = Path(tmp_name)
        try:
            copied_mtime_ns = None
            if self._can_link(source):
                os.close(fd)
                sha256, size = self._link_and_hash(source, tmp)
            else:
                try:
                    sha256, size = copy_and_hash(source, fd)
                    copied_mtime_ns = os.fstat(fd).st_mtime_ns
                finally:
                    os.close(fd)
            if expected_sha256 is not None and sha256 != expected_sha256:
                raise IntegrityError(
                    f"{source}: stored bytes hash to {sha256}, expected {expected_sha256}; not stored"
                )
            final = self._final_path(sha256)
            final.parent.mkdir(parents=True, exist_ok=True)
            if not final.exists():
                os.chmod(tmp, 0o444)
                is_new = commit_file(tmp, final, exclusive=True)  # equal bytes under an equal key: keep one
                if is_new and copied_mtime_ns is not None:
                    self._witness(final, sha256, size, copied_mtime_ns)
            return StoredArtifact(sha256, size, self.uri(sha256))
        finally:
            tmp.unlink(missing_ok=True)

    def _witness(self, final: Path, sha256: str, size: int, copied_mtime_ns: int) -> None:
        """Remember that this process wrote `final` and hashed its bytes, as its stat shows it now.

        Only copies are remembered: the store created the file, wrote every byte through its
        own descriptor and hashed what it wrote. An mtime that moved since the last write means
        someone else wrote too, and the file is not vouched for.
        """
        stat = final.stat()
        if stat.st_size != size or stat.st_mtime_ns != copied_mtime_ns:
            return
        with self._witness_lock:
            self._witnessed[(stat.st_dev, stat.st_ino)] = (size, stat.st_mtime_ns, stat.st_ctime_ns, sha256)
            while len(self._witnessed) > _WITNESS_LIMIT:
                self._witnessed.popitem(last=False)

    def witnessed(self, path: Path) -> StoredArtifact | None:
        """The digest this store computed for the file at `path` when it wrote it, if unchanged since.

        "Unchanged" means same inode, size, mtime and ctime: any write or mode change since
        moves ctime, so a file edited after it was stored is hashed again by whoever asks. The
        check is as fine as the file system's timestamps: Linux 6.13+ gives a changed inode a
        fresh fine-grained ctime once it has been stat'ed (the store stats it right after the
        rename); older kernels stamp with the clock tick (1-4 ms), and a write within the tick
        of the store's own rename would go unseen. None for any other file.
        """
        try:
            stat = os.stat(path)
        except OSError:
            return None
        with self._witness_lock:
            known = self._witnessed.get((stat.st_dev, stat.st_ino))
        if known is None:
            return None
        size, mtime_ns, ctime_ns, sha256 = known
        if (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns) != (size, mtime_ns, ctime_ns):
            return None
        return StoredArtifact(sha256, size, self.uri(sha256))

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
        # The store's name and the digest, not a file:// path: URIs travel in provenance statements,
        # bundles and API answers, where the server's folders are nobody's business.
        return f"{LOCAL_URI_PREFIX}{check_digest(sha256)}"

    def remove(self, sha256: str) -> int:
        final = self._final_path(sha256)
        try:
            size = final.stat().st_size
            final.unlink()
        except FileNotFoundError:
            return 0
        return size

    def remove_tmp(self) -> int:
        """Delete leftovers of interrupted puts; returns how many were removed."""
        count = 0
        for leftover in (self.root / "tmp").iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            count += 1
        return count
