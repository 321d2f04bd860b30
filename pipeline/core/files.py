"""File primitives every writer shares: atomic writes, streamed sha256, confined relative names.

Every file the pipeline writes appears under its final name complete or not at all: it is
written under a hidden temporary name in the same folder, flushed to disk, then renamed
(`atomic_path`). A crash mid-write leaves only a ``.partial`` file, which no reader looks at.

Example::

    with atomic_path(workdir / "manifest.json") as tmp:
        tmp.write_text(text, encoding="utf-8")
    write_json(workdir / "model_card.json", card)   # the same, for a JSON document
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.core.errors import InputError, IntegrityError

__all__ = [
    "atomic_path", "commit_file", "write_json", "sha256_file", "safe_relpath", "require_free_space",
    "PARTIAL_SUFFIX",
]

PARTIAL_SUFFIX = ".partial"


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # some file systems do not open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_file(tmp: Path, dest: Path, *, exclusive: bool = False, durable: bool = True) -> bool:
    """Flush `tmp` to disk and rename it to `dest`; returns False (and drops `tmp`) when
    `exclusive` and `dest` already exists, so a stored file is never replaced. ``durable=False``
    skips the flushes: for a scratch file that lives only while one stage runs."""
    if durable:
        with open(tmp, "rb") as handle:  # fsync needs no write access
            os.fsync(handle.fileno())
    if exclusive:
        try:
            os.link(tmp, dest)  # fails if dest exists: no window in which it is overwritten
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            return False
        except OSError:  # a file system without hard links: check, then rename
            if dest.exists():
                tmp.unlink(missing_ok=True)
                return False
            os.replace(tmp, dest)
        else:
            tmp.unlink()
    else:
        os.replace(tmp, dest)
    if durable:
        _fsync_dir(dest.parent)
    return True


@contextmanager
def atomic_path(dest: Path, *, overwrite: bool = False, durable: bool = True) -> Iterator[Path]:
    """A temporary path beside `dest`; renamed to `dest` when the block ends without error
    (flushed to disk first unless ``durable=False``, see `commit_file`).

    Raises InputError before anything is written when `dest` exists and `overwrite` is False.
    On any error the temporary file is removed and `dest` is untouched.
    """
    dest = Path(dest)
    if not overwrite and dest.exists():
        raise InputError(f"{dest} already exists; files here are never overwritten")
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
    try:
        yield tmp
        if not tmp.exists():
            raise IntegrityError(f"{dest}: nothing was written to {tmp.name}")
        if not commit_file(tmp, dest, exclusive=not overwrite, durable=durable):
            raise InputError(f"{dest} appeared while it was being written; it was left as it was")
    finally:
        tmp.unlink(missing_ok=True)


def write_json(dest: Path, document: Any, *, indent: int | None = 2, sort_keys: bool = False,
               allow_nan: bool = True, overwrite: bool = False) -> str:
    """Write `document` as JSON at `dest` atomically, re-read it and compare; returns the text.

    The comparison is of text, not parsed values (a NaN never equals itself).
    Raises IntegrityError when the bytes on disk differ from what was written.
    """
    text = json.dumps(document, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan) + "\n"
    with atomic_path(dest, overwrite=overwrite) as tmp:
        tmp.write_text(text, encoding="utf-8")
    if dest.read_text(encoding="utf-8") != text:
        raise IntegrityError(f"{dest}: re-read content differs from what was written")
    return text


# Headroom kept free beyond what a stage says it needs (logs, databases, other work on the disk).
_FREE_MARGIN_BYTES = 256 << 20


def require_free_space(folder: Path, needed_bytes: int, what: str) -> int:
    """Refuse, before writing anything, when `folder`'s file system cannot take `needed_bytes`.

    Returns the free bytes. InputError names both numbers and the fix.
    """
    free = shutil.disk_usage(folder).free
    if needed_bytes > 0 and needed_bytes + _FREE_MARGIN_BYTES > free:
        raise InputError(
            f"not enough disk space for {what}: needs {_gb(needed_bytes)} (+{_gb(_FREE_MARGIN_BYTES)} "
            f"headroom) in {folder}, {_gb(free)} free; free some space, or point BONSAI_WORK_ROOT "
            "at a larger disk"
        )
    return free


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (never reads the whole file into memory)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def safe_relpath(name: str) -> PurePosixPath:
    """Check that a repository file name stays inside its folder.

    Raises InputError for absolute paths, `..` parts, backslashes or empty names:
    hostile repositories use them to write outside the snapshot.
    """
    if not name or "\\" in name or "\x00" in name:
        raise InputError(f"file name {name!r} is not a plain relative path; refusing it")
    rel = PurePosixPath(name)
    if rel.is_absolute() or any(part in ("..", ".", "") for part in rel.parts):
        raise InputError(
            f"file name {name!r} escapes the snapshot folder (absolute or '..'); refusing it"
        )
    return rel
