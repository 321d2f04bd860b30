"""Copy a file and hash the copy in one pass: the kernel copies, a second thread hashes what landed.

The digest is computed from the *destination's* bytes, chunk by chunk as each chunk is
written, never from the source: a source that changes during the copy cannot give a digest
that differs from what was stored. The copy itself runs in the kernel (``copy_file_range``),
and the hasher reads each copied chunk through a mapping of the destination, so the bytes are
never copied into user space; a third thread flushes finished chunks to disk while later ones
are copied, so the closing ``fsync`` has little left to do.

    digest, size_bytes = copy_and_hash(Path("model.safetensors"), fd)  # fd: open for read+write
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["copy_and_hash"]

_CHUNK_BYTES = 64 * 1024 * 1024
_SYNC_EVERY_BYTES = 128 * 1024 * 1024
_READ_BYTES = 8 * 1024 * 1024
# copy_file_range refuses some pairs (old kernels across file systems, special files): copy by hand.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


def copy_and_hash(source: Path, dst_fd: int) -> tuple[str, int]:
    """Copy `source` into the empty file `dst_fd` (opened read+write), fsync it; (sha256 hex, bytes).

    Raises OSError from the file system.
    """
    with open(source, "rb", buffering=0) as src:
        try:
            return _kernel_copy(src.fileno(), dst_fd)
        except _NoKernelCopy:
            os.ftruncate(dst_fd, 0)
            return _user_copy(src.fileno(), dst_fd)


class _NoKernelCopy(Exception):
    """copy_file_range does not work for this pair of files."""


class _Worker:
    """One background thread that runs `step(item)` for each queued item, in order."""

    def __init__(self, step: Callable[[tuple[int, int]], None]) -> None:
        self._step = step
        self._items: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._items.get()) is not None:
            if self._error is None:
                try:
                    self._step(item)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by join()
                    self._error = exc

    def put(self, item: tuple[int, int]) -> None:
        self._items.put(item)

    def join(self) -> None:
        self._items.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def _kernel_copy(src_fd: int, dst_fd: int) -> tuple[str, int]:
    digest = hashlib.sha256()

    def hash_range(item: tuple[int, int]) -> None:
        offset, length = item
        # The copied chunk hashed straight from the page cache, in one call: no copy into user
        # space, and one GIL release per chunk, so a busy thread elsewhere in the process (a
        # background import) rarely makes the hasher wait for the GIL.
        with mmap.mmap(dst_fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset) as mapped:
            digest.update(mapped)

    hasher = _Worker(hash_range)
    syncer = _Worker(lambda _item: os.fdatasync(dst_fd))
    offset = synced = 0
    try:
        while True:
            try:
                copied = os.copy_file_range(src_fd, dst_fd, _CHUNK_BYTES, offset, offset)
            except OSError as exc:
                if offset == 0 and exc.errno in _NO_KERNEL_COPY:
                    raise _NoKernelCopy from exc
                raise
            if copied == 0:
                break
            hasher.put((offset, copied))
            offset += copied
            if offset - synced >= _SYNC_EVERY_BYTES:
                syncer.put((synced, offset))
                synced = offset
    finally:
        hasher.join()
        syncer.join()
    os.fsync(dst_fd)
    return digest.hexdigest(), offset


def _user_copy(src_fd: int, dst_fd: int) -> tuple[str, int]:
    """Read, hash and write the same buffer: the slow path where the kernel cannot copy."""
    digest = hashlib.sha256()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    size_bytes = 0
    while got := os.readv(src_fd, [buffer]):
        digest.update(view[:got])
        written = 0
        while written < got:
            written += os.write(dst_fd, view[written:got])
        size_bytes += got
    os.fsync(dst_fd)
    return digest.hexdigest(), size_bytes
