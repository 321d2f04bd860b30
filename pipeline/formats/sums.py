"""SHA256SUMS files: ``sha256sum`` output (GNU or BSD style) mapping file names to digests."""

from __future__ import annotations

import re

from pipeline.core.errors import IntegrityError
from pipeline.core.files import safe_relpath

__all__ = ["SUMS_NAME", "parse_sha256sums"]

SUMS_NAME = "SHA256SUMS"

_GNU_LINE = re.compile(r"(?P<hex>[0-9a-fA-F]{64}) [ *](?P<name>.+)")
_BSD_LINE = re.compile(r"SHA256 \((?P<name>.+)\) = (?P<hex>[0-9a-fA-F]{64})")


def parse_sha256sums(text: str, *, source_name: str = SUMS_NAME) -> dict[str, str]:
    """Map of name -> lowercase hex from a sha256sum-style file.

    Accepts GNU lines (``<hex>  <name>``, ``<hex> *<name>``) and BSD lines
    (``SHA256 (<name>) = <hex>``); blank lines and ``#`` comments are skipped.
    Raises IntegrityError for malformed lines or one name listed with two digests, and
    InputError for names that leave the snapshot.
    """
    sums: dict[str, str] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _GNU_LINE.fullmatch(line) or _BSD_LINE.fullmatch(line)
        if match is None:
            raise IntegrityError(
                f"{source_name} line {line_no}: {line[:120]!r} is not '<sha256 hex>  <name>'; "
                "fix or remove the file"
            )
        name = match.group("name")
        while name.startswith("./"):
            name = name[2:]
        name = safe_relpath(name).as_posix()
        digest = match.group("hex").lower()
        if sums.get(name, digest) != digest:
            raise IntegrityError(f"{source_name} lists {name!r} twice with different digests")
        sums[name] = digest
    return sums
