"""Build a real huggingface_hub cache layout on disk, for offline tests of the hub path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-llama"


def build_hub_cache(
    cache: Path, files: dict[str, bytes], *, repo_id: str = REPO, commit: str = COMMIT,
    refs: tuple[str, ...] = ("main",), with_tree: bool = True,
) -> Path:
    """Lay out a huggingface_hub cache as snapshot_download leaves it; returns the repo folder.

    blobs/<id> hold the bytes, snapshots/<commit>/<name> are relative symlinks to them,
    refs/<branch> name the commit, trees/<commit>.json is the hub's listing with LFS sha256.
    """
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    tree: dict[str, dict[str, object]] = {}
    for rel, data in files.items():
        sha256 = hashlib.sha256(data).hexdigest()
        is_lfs = rel.endswith(".safetensors")
        blob_id = sha256 if is_lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / blob_id
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        entry: dict[str, object] = {"size": len(data), "blob_id": blob_id}
        if is_lfs:
            entry.update(lfs_sha256=sha256, lfs_size=len(data))
        tree[rel] = entry
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    if with_tree:
        (repo / "trees").mkdir(exist_ok=True)
        (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    return repo


def cache_from_folder(cache: Path, folder: Path, **kwargs: object) -> Path:
    """A hub cache holding every file of `folder` (a checkpoint written by a test)."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file())
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in paths}
    return build_hub_cache(cache, files, **kwargs)  # type: ignore[arg-type]
