"""Where a submitter may publish: `PublishPolicy` confines API publishing to configured folders
(``BONSAI_PUBLISH_ROOTS``) and bucket prefixes (``BONSAI_PUBLISH_BUCKETS``).

A folder is placed by its text first (``..`` and ``~`` applied, nothing opened), then by where its
nearest existing parent leads (symlinks); both must be inside a root. A bucket destination must be
a listed ``s3://bucket/prefix`` or lie below one, on a ``/`` boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.confinement import confinement_roots, is_inside, placed
from pipeline.core.errors import InputError
from pipeline.core.text import first_unprintable

__all__ = ["PublishPolicy", "MAX_DESTINATION_CHARS"]

MAX_DESTINATION_CHARS = 1024


@dataclass(frozen=True)
class PublishPolicy:
    """``roots``: allowed folders (as written and resolved); ``buckets``: allowed (bucket, prefix)."""

    roots: tuple[Path, ...] = ()
    buckets: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_settings(cls, roots: Iterable[str], buckets: Iterable[str]) -> PublishPolicy:
        places = []
        for url in buckets:
            bucket, _, prefix = url.removeprefix("s3://").partition("/")
            if not url.startswith("s3://") or not bucket:
                raise InputError(f"BONSAI_PUBLISH_BUCKETS entry {url!r} is not s3://bucket[/prefix]")
            places.append((bucket, prefix.strip("/")))
        return cls(confinement_roots(roots), tuple(places))

    def check(self, dest: str) -> str:
        """``dest`` as it will be written to (a folder's absolute path, or the s3:// URL);
        InputError naming the setting when it is outside what is configured."""
        if not self.roots and not self.buckets:
            raise InputError("publishing through the API is off: the operator lists where bundles may go in "
                             "BONSAI_PUBLISH_ROOTS (folders) or BONSAI_PUBLISH_BUCKETS (s3://bucket/prefix)")
        if len(dest) > MAX_DESTINATION_CHARS or first_unprintable(dest) is not None:
            raise InputError(f"publish destination must be at most {MAX_DESTINATION_CHARS} printable "
                             "characters")
        if dest.startswith("s3://"):
            return self._bucket(dest)
        lexical = placed(dest)
        try:
            leads_to = _existing_parent(lexical).resolve()
        except (OSError, RuntimeError):  # a symlink loop
            raise self._outside(dest) from None
        if not self._inside(lexical) or not self._inside(leads_to):
            raise self._outside(dest)
        return str(lexical)

    def _bucket(self, dest: str) -> str:
        bucket, _, prefix = dest[len("s3://"):].partition("/")
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise self._outside(dest)
        key = "/".join(parts)
        for allowed_bucket, allowed_prefix in self.buckets:
            if bucket == allowed_bucket and (not allowed_prefix or key == allowed_prefix
                                             or key.startswith(allowed_prefix + "/")):
                return f"s3://{bucket}/{key}".rstrip("/")
        raise self._outside(dest)

    def _inside(self, path: Path) -> bool:
        return is_inside(path, self.roots)

    def _outside(self, dest: str) -> InputError:
        places = [str(r) for r in self.roots] + [f"s3://{b}/{p}".rstrip("/") for b, p in self.buckets]
        return InputError(f"publish destination {dest[:200]!r} is outside the allowed places "
                          f"({', '.join(places)}); "
                          "publish below one of them, or ask the operator to add it to BONSAI_PUBLISH_ROOTS "
                          "or BONSAI_PUBLISH_BUCKETS")


def _existing_parent(path: Path) -> Path:
    """``path`` itself or its nearest existing ancestor (where a symlink could lead elsewhere)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor)
