"""Stage 2, checksum: prove the downloaded files are the files that were published.

Every ``download/<name>`` input is hashed from its bytes (streamed, once, files in parallel
across cores) and compared with the digest the artifact store recorded, then with every
reference the snapshot carries. A file the store itself wrote and hashed in this process,
and that is provably unchanged since (client ``store_witness``, a `DigestWitness`), is not
read again: its bytes were hashed as they were stored, one read per byte in all.

- ``SHA256SUMS`` (lines ``<hex>  <name>`` or ``<hex> *<name>``); a listed file that is
  missing is an error too;
- ``hub_files.json`` written by the download stage: the hub's size and LFS sha256 per file.

Output: ``manifest.json`` (kind ``manifest``)::

    {"files": [{"name": ..., "sha256": ..., "size_bytes": ...}, ...],
     "verified_against": ["SHA256SUMS", "hub_files.json"], "total_bytes": ...}

Any mismatch raises IntegrityError naming the file, the reference, and both digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.manifest import MANIFEST_NAME, FileDigest, Manifest
from pipeline.formats.sums import SUMS_NAME, parse_sha256sums
from pipeline.stages.base import (
    NO_CLIENTS,
    DigestWitness,
    InputFile,
    JobSpec,
    OutputFile,
    StageClients,
    StageResult,
    inputs_of,
)
from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import no_memory_need as memory_need
from pipeline.stages.base import nothing_beyond_params as cache_identity

__all__ = [
    "NAME",
    "VERSION",
    "FANOUT",
    "select_inputs",
    "memory_need",
    "cache_identity",
    "MANIFEST_NAME",
    "SUMS_NAME",
    "FileDigest",
    "Params",
    "hash_file",
    "make_params",
    "run",
]

# Runs whole: no fan-out by shard.
FANOUT = None

NAME = "checksum"
VERSION = "1"
_HUB_FILES_NAME = "hub_files.json"  # written by the download stage
_MAX_REFERENCE_BYTES = 64 * 1024 * 1024  # a sums file or listing larger than this is not one
_MAX_REPORTED = 20



@dataclass(frozen=True)
class Params:
    """The checksum stage has no knobs: what to verify against comes from the snapshot."""


def make_params(job: JobSpec) -> Params:
    """Checksum parameters from a job (none)."""
    return Params()


def hash_file(name: str, path: Path) -> FileDigest:
    """Stream `path` through sha256 once; size comes from the open handle, so they agree."""
    with open(path, "rb") as handle:
        size_bytes = os.fstat(handle.fileno()).st_size
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return FileDigest(name=name, sha256=digest, size_bytes=size_bytes)


def run(
    params: Params,
    inputs: Mapping[str, InputFile],
    workdir: Path,
    clients: StageClients = NO_CLIENTS,
) -> StageResult:
    """Hash every downloaded file, verify against every reference, write ``manifest.json``.

    Clients: ``store_witness`` (optional `DigestWitness`): files it vouches for are not re-read.
    Raises IntegrityError on any mismatch or missing listed file, InputError when there is
    nothing to hash.
    """
    files = inputs_of(inputs, "download")
    if not files:
        raise InputError("checksum: no download/<name> inputs; the download stage produced nothing")
    started = time.perf_counter()
    digests, hashed_bytes, witnessed_count = _digests(files, clients.store_witness)
    hash_seconds = time.perf_counter() - started

    problems: list[str] = []
    verified_against: list[str] = []
    warnings: list[str] = []
    snapshot = {name: d for name, d in digests.items() if name != _HUB_FILES_NAME}
    if SUMS_NAME in files:
        sums = parse_sha256sums(_read_reference(files[SUMS_NAME]))
        problems += _compare_sums(sums, snapshot)
        verified_against.append(SUMS_NAME)
    if _HUB_FILES_NAME in files:
        hub_problems, unlisted = _compare_hub(_load_hub_files(files[_HUB_FILES_NAME]), snapshot)
        problems += hub_problems
        verified_against.append(_HUB_FILES_NAME)
        if unlisted:
            warnings.append(f"files not in the hub listing (not verified by it): {', '.join(unlisted[:10])}")
    if problems:
        shown = problems[:_MAX_REPORTED]
        more = f"\n... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise IntegrityError(
            f"checksum: {len(problems)} file(s) do not match what was published:\n" + "\n".join(shown) + more
        )
    if not verified_against:
        warnings.append("no SHA256SUMS and no hub metadata: digests recorded but not verified")

    total_bytes = sum(d.size_bytes for d in snapshot.values())
    output = _write_manifest(workdir, snapshot, verified_against)
    metrics = {
        "file_count": len(snapshot),
        "total_bytes": total_bytes,
        "verified_against": verified_against,
        "hashed_bytes": hashed_bytes,
        "witnessed_count": witnessed_count,
        "hash_seconds": round(hash_seconds, 3),
        "hash_mb_per_s": round(hashed_bytes / 1e6 / hash_seconds, 1) if hash_seconds > 0 else None,
    }
    return StageResult(outputs=(output,), metrics=metrics, warnings=tuple(warnings))


def _digests(
    files: Mapping[str, InputFile], witness: DigestWitness | None
) -> tuple[dict[str, FileDigest], int, int]:
    """Each file's digest, checked against the store record; bytes hashed; files taken from the witness.

    Files the witness vouches for are taken from it; the others are hashed in parallel
    (hashlib releases the GIL, so threads use every core).
    """
    vouched: dict[str, FileDigest] = {}
    to_hash: list[tuple[str, InputFile]] = []
    for name, item in sorted(files.items()):
        known = witness.witnessed(item.path) if witness is not None else None
        if known is not None:
            vouched[name] = FileDigest(name=name, sha256=known.sha256, size_bytes=known.size_bytes)
        else:
            to_hash.append((name, item))
    workers = max(1, min(len(to_hash), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checksum") as pool:
        hashed = {d.name: d for d in pool.map(lambda pair: hash_file(pair[0], pair[1].path), to_hash)}
    digests = {**vouched, **hashed}
    for name, item in sorted(files.items()):
        _check_store_record(name, item, digests[name])
    return dict(sorted(digests.items())), sum(d.size_bytes for d in hashed.values()), len(vouched)


def _check_store_record(name: str, item: InputFile, digest: FileDigest) -> None:
    """The bytes must also match what the artifact store says it holds."""
    if item.sha256 and item.sha256.lower() != digest.sha256:
        raise IntegrityError(
            f"{name}: sha256 mismatch against the artifact store record: expected {item.sha256.lower()}, "
            f"actual {digest.sha256} (stored copy corrupted or replaced)"
        )


def _read_reference(item: InputFile) -> str:
    size_bytes = item.path.stat().st_size
    if size_bytes > _MAX_REFERENCE_BYTES:
        raise IntegrityError(f"{item.name}: {size_bytes} bytes is too large for a checksum list")
    try:
        return item.path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{item.name}: not UTF-8 text ({exc})") from exc


def _compare_sums(sums: Mapping[str, str], snapshot: Mapping[str, FileDigest]) -> list[str]:
    problems = []
    for name, expected in sorted(sums.items()):
        if name == SUMS_NAME:
            continue
        actual = snapshot.get(name)
        if actual is None:
            problems.append(
                f"{name}: listed in {SUMS_NAME} (sha256 {expected}) but missing from the snapshot"
            )
        elif actual.sha256 != expected:
            problems.append(
                f"{name}: sha256 mismatch against {SUMS_NAME}: expected {expected}, actual {actual.sha256}"
            )
    return problems


def _load_hub_files(item: InputFile) -> list[dict[str, Any]]:
    try:
        document = json.loads(_read_reference(item))
        entries = document["files"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e for e in entries):
            raise TypeError("'files' must be a list of objects with a 'name'")
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{item.name}: not a valid hub file listing ({exc})") from exc
    return entries


def _compare_hub(
    entries: list[dict[str, Any]], snapshot: Mapping[str, FileDigest]
) -> tuple[list[str], list[str]]:
    """Problems found, and snapshot files the hub listing does not mention."""
    problems = []
    listed = set()
    for entry in entries:
        name = str(entry["name"])
        listed.add(name)
        actual = snapshot.get(name)
        expected_sha = entry.get("sha256")
        expected_size = entry.get("size_bytes")
        if actual is None:
            problems.append(f"{name}: listed by the hub ({_HUB_FILES_NAME}) but missing from the snapshot")
            continue
        if expected_sha and str(expected_sha).lower() != actual.sha256:
            problems.append(
                f"{name}: sha256 mismatch against the hub's LFS sha256 ({_HUB_FILES_NAME}): "
                f"expected {str(expected_sha).lower()}, actual {actual.sha256}"
            )
        elif expected_size is not None and int(expected_size) != actual.size_bytes:
            problems.append(
                f"{name}: size mismatch against the hub ({_HUB_FILES_NAME}): "
                f"expected {int(expected_size)} bytes, actual {actual.size_bytes} (sha256 {actual.sha256})"
            )
    unlisted = sorted(name for name in snapshot if name not in listed)
    return problems, unlisted


def _write_manifest(
    workdir: Path, snapshot: Mapping[str, FileDigest], verified_against: list[str]
) -> OutputFile:
    manifest = Manifest(tuple(snapshot[name] for name in sorted(snapshot)), tuple(verified_against))
    path = workdir / MANIFEST_NAME
    manifest.write(path)
    return OutputFile(name=MANIFEST_NAME, path=path, kind="manifest", media_type="application/json")
