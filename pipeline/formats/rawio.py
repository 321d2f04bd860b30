"""Bounded-memory file I/O for tensors: read exactly one tensor's bytes, copy byte ranges between files.

Memory-mapping a whole shard makes every page a tensor touches count in the process's memory
until the map closes, so a 4 GB shard costs 4 GB of RSS by its end. Here each tensor is mapped
on its own (`mapped_bytes`: private, copy-on-write, so a write never reaches the file), and the
mapping goes when the last view of it does, so memory stays at a few tensors whatever the
model size; its bytes are read straight from the page cache, with no copy (1 GB: 0.04 s
against 0.2-0.3 s for ``pread`` into a buffer here). A tensor wanted in another row order, or
converted, lands in a buffer that is reused for the next one (fresh pages, which cost ~1 ms per
MB to fault in on some virtual machines, are not needed again and again). Byte ranges are
copied file to file with ``os.copy_file_range`` (in the kernel, no user-space buffer).

Headers are read and validated by the one safetensors header reader (`formats.safetensors`).
"""

from __future__ import annotations

import functools
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.core.errors import IntegrityError
from pipeline.formats.safetensors import DTYPE_SIZE_BYTES, TensorInfo, read_header

__all__ = [
    "mapped_bytes",
    "pread_exact",
    "copy_range",
    "ReusableBuffers",
    "SafetensorsReader",
    "ITEM_BYTES",
]

_COPY_CHUNK = 1 << 30

# safetensors dtype -> bytes per element: the one table the header reader uses too.
ITEM_BYTES = DTYPE_SIZE_BYTES


def mapped_bytes(fd: int, offset: int, n_bytes: int, what: str) -> npt.NDArray[np.uint8]:
    """``n_bytes`` of ``fd`` from ``offset`` as a private mapping (copy-on-write: a write stays in
    this process), unmapped when the last view of it goes; IntegrityError naming ``what`` when the
    file ends first. Reads come straight from the page cache, with no copy."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset + n_bytes - start
    if os.fstat(fd).st_size < start + length:
        raise IntegrityError(f"file ended before {what} (bytes {offset}..{offset + n_bytes})")
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mapped = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=prot, offset=start)
    return np.frombuffer(mapped, np.uint8, count=n_bytes, offset=offset - start)


def pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; IntegrityError if the file ends first."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise IntegrityError(f"file ended {len(buf) - done} bytes early at offset {offset + done}")
        done += got


def copy_range(src_fd: int, src_offset: int, dst_fd: int, n_bytes: int) -> None:
    """Append ``n_bytes`` of ``src_fd`` from ``src_offset`` at ``dst_fd``'s current position."""
    done = 0
    while done < n_bytes:
        try:
            got = os.copy_file_range(src_fd, dst_fd, min(n_bytes - done, _COPY_CHUNK), src_offset + done)
        except OSError:  # e.g. across filesystems on old kernels: plain reads and writes
            got = 0
        if got <= 0:
            _copy_by_reads(src_fd, src_offset + done, dst_fd, n_bytes - done)
            return
        done += got


def _copy_by_reads(src_fd: int, src_offset: int, dst_fd: int, n_bytes: int) -> None:
    buf = bytearray(min(n_bytes, 16 << 20))
    view = memoryview(buf)
    done = 0
    while done < n_bytes:
        part = view[: min(len(buf), n_bytes - done)]
        pread_exact(src_fd, part, src_offset + done)
        os.write(dst_fd, part)
        done += len(part)


class ReusableBuffers:
    """A few numpy buffers handed out again once nothing references them any more.

    `get` returns a buffer (1-D, ``dtype``, at least ``n`` items) that no array or tensor
    outside this pool still uses: a buffer is reused only when its reference count shows
    that every view of it (numpy slices, tensors made by ``torch.from_numpy``) is gone. A
    caller that keeps everything it is given just gets fresh buffers.
    """

    def __init__(self, dtype: npt.DTypeLike, keep: int = 2) -> None:
        self._dtype = np.dtype(dtype)
        self._keep = keep
        self._buffers: list[npt.NDArray[Any]] = []

    def get(self, n: int) -> npt.NDArray[Any]:
        for i in range(len(self._buffers)):
            # 2 = the list's reference + getrefcount's argument: no view of it is alive.
            if sys.getrefcount(self._buffers[i]) <= 2:
                if self._buffers[i].size < n:
                    self._buffers[i] = np.empty(n, self._dtype)
                return self._buffers[i][:n]
        buf = np.empty(n, self._dtype)
        if len(self._buffers) < self._keep:
            self._buffers.append(buf)
        return buf[:n]


class SafetensorsReader:
    """Reads one safetensors file tensor by tensor; use as a context manager.

    `tensor` returns a torch tensor backed by a mapping of the file (or, for a row permutation or
    a conversion, by a `ReusableBuffers` buffer): it stays valid for as long as the caller keeps
    it (or any view of it), and its memory is unmapped or reused only after that.
    """

    STORED_FLOATS = ("BF16", "F16", "F32")  # dtypes `tensor` can hand out as stored

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        header = read_header(self.path)
        self.entries: dict[str, TensorInfo] = {t.name: t for t in header.tensors}
        self.metadata = header.metadata
        self._fd = -1
        self._scratch = ReusableBuffers(np.uint8, keep=1)  # stored bytes before a conversion
        self._stored = ReusableBuffers(np.uint8, keep=2)  # stored bytes handed out as they are
        self._values = ReusableBuffers(np.float32, keep=2)  # float32 conversions handed out

    def __enter__(self) -> SafetensorsReader:
        self._fd = os.open(self.path, os.O_RDONLY)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
        self._fd = -1

    def tensor(self, name: str, row_order: Any = None, as_stored: bool = False) -> Any:
        """Tensor ``name`` as float32 (torch), or in its stored dtype when ``as_stored`` and that is
        BF16, F16 or F32 (no conversion pass, half the memory for 16-bit weights); rows
        reordered so that row i is stored row ``row_order[i]`` when a permutation is given."""
        import torch

        entry = self.entries[name]
        n = int(np.prod(entry.shape, dtype=np.int64))
        dtype = _torch_dtype(entry.dtype)
        keep = entry.dtype == "F32" or (as_stored and entry.dtype in self.STORED_FLOATS)
        if n and row_order is None:
            raw = self._mapped(entry)
        else:
            raw = (self._stored if keep else self._scratch).get(entry.size_bytes)
            if n:
                self._read_permuted(entry, raw, np.asarray(row_order, dtype=np.int64))
        stored = (
            torch.frombuffer(raw, dtype=dtype).view(entry.shape)
            if n
            else torch.empty(entry.shape, dtype=dtype)
        )
        if keep:
            return stored
        values = torch.from_numpy(self._values.get(n)).view(entry.shape)
        return values.copy_(stored)

    def float32(self, name: str, row_order: Any = None) -> Any:
        """`tensor` as float32."""
        return self.tensor(name, row_order)

    def _mapped(self, entry: TensorInfo) -> npt.NDArray[np.uint8]:
        what = f"{self.path.name}'s tensor {entry.name!r}"
        return mapped_bytes(self._fd, entry.begin, entry.size_bytes, what)

    def _read_permuted(self, entry: TensorInfo, raw: npt.NDArray[np.uint8], order: Any) -> None:
        rows = entry.shape[0]
        if sorted(order.tolist()) != list(range(rows)):
            raise ValueError(f"row order for a {rows}-row tensor is not a permutation of its rows")
        row_bytes = entry.size_bytes // rows
        stored = self._mapped(entry).reshape(rows, row_bytes)
        np.take(stored, order, axis=0, out=raw.reshape(rows, row_bytes))


@functools.cache
def _torch_dtype(name: str) -> Any:
    import torch

    attr = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "F16": "float16",
        "BF16": "bfloat16",
        "I32": "int32",
        "U32": "uint32",
        "F32": "float32",
        "I64": "int64",
        "U64": "uint64",
        "F64": "float64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
    }[name]
    if not hasattr(torch, attr):
        raise IntegrityError(f"safetensors dtype {name!r} has no torch equivalent in this torch version")
    return getattr(torch, attr)
