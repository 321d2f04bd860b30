"""Stage 1, download: bring a checkpoint's files into the work folder.

Accepted source specs:

- a local folder (``/models/llama``): every file below it;
- a single ``.gguf`` file (``/models/llama-f16.gguf``);
- a Hugging Face repo ``org/name`` or ``org/name@revision`` (``hf://`` prefix optional);
  the revision (branch, tag or sha) is resolved to the full commit sha and recorded.

Only checkpoint files are taken (`sources.is_checkpoint_file`: weights, config, tokenizer,
checksums, model card, licence); the rest are listed in the metrics and a warning and never
stored. Each taken file becomes an output named by its relative POSIX name (kind
``source-file``), hard-linked or copied into ``workdir/snapshot/``. A local source is checked
against the `sources.SourcePolicy` client (the allowed model folders) again here. For hub
sources the hub's per-file size and LFS sha256 go into ``hub_files.json`` (kind
``hub-metadata``) for the checksum stage.
Hostile names (``..``, absolute paths, symlinks resolving outside the source) are refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.clients.hub import HfHubClient, HubClient, HubFile
from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.files import atomic_path, require_free_space, safe_relpath, write_json
from pipeline.stages.base import (
    NO_CLIENTS,
    SOURCE_REVISION_METRIC,
    InputFile,
    JobSpec,
    OutputFile,
    StageClients,
    StageResult,
)
from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import no_memory_need as memory_need
from pipeline.stages.sources import (
    ACCEPTED_FORMS,
    CHECKPOINT_PATTERNS,
    PICKLE_SUFFIXES,
    SourcePolicy,
    is_checkpoint_file,
    parse_source,
)

__all__ = [
    "NAME",
    "VERSION",
    "FANOUT",
    "select_inputs",
    "memory_need",
    "HUB_FILES_NAME",
    "Params",
    "cache_identity",
    "make_params",
    "run",
]

# Runs whole: no fan-out by shard.
FANOUT = None

NAME = "download"
VERSION = "1"
HUB_FILES_NAME = "hub_files.json"

logger = logging.getLogger(__name__)

# Folders that are tooling state, not checkpoint content.
_JUNK_DIRS = frozenset({".git", ".cache", ".hg", ".svn", "__pycache__"})
_JUNK_FILES = frozenset({".DS_Store"})
_MAX_LISTED = 20  # left-out names shown in a warning


@dataclass(frozen=True)
class Params:
    """`source` is the job's source spec exactly as submitted."""

    source: str


def make_params(job: JobSpec) -> Params:
    """Download parameters from a job: only the source spec matters."""
    return Params(source=job.source.strip())


def cache_identity(params: Params, clients: StageClients = NO_CLIENTS) -> str | None:
    """What decides the download's result beyond `params`: the commit a hub revision points to now.

    A moved branch thus gives a new cache key. None (never reuse) for local folders and files:
    their bytes may change under the same path, and redoing a local download is cheap (hard
    links); checksum still reuses its work when the digests are unchanged.
    """
    source = parse_source(params.source)
    if source.kind != "hub":
        return None
    assert source.repo_id is not None
    client: HubClient = clients.hub or HfHubClient()
    return f"hub:{source.repo_id}@{client.resolve_revision(source.repo_id, source.revision)}"


def run(
    params: Params,
    inputs: Mapping[str, InputFile],
    workdir: Path,
    clients: StageClients = NO_CLIENTS,
) -> StageResult:
    """Materialise the source's files under ``workdir/snapshot``.

    Clients: ``hub`` (default `HfHubClient()`), used only for hub sources; ``source_policy``.
    Raises InputError (missing source, unknown repo/revision, hostile names), TransientError
    (hub unreachable or 5xx) and IntegrityError (a file changed size while being copied).
    """
    policy = clients.source_policy or SourcePolicy(allow_any_local=True)
    # Checked again here, not only at submit: a symlink may have moved since.
    source = policy.check(params.source)
    metrics: dict[str, Any] = {"source_kind": source.kind}
    hub_files: list[HubFile] | None = None
    if source.kind == "hub":
        assert source.repo_id is not None
        hub: HubClient = clients.hub or HfHubClient()
        commit_sha = hub.resolve_revision(source.repo_id, source.revision)
        logger.info("download: %s@%s resolved to %s", source.repo_id, source.revision or "main", commit_sha)
        hub_files = hub.list_files_with_sha256(source.repo_id, commit_sha)
        listed = sum(f.size_bytes or 0 for f in hub_files if is_checkpoint_file(f.name))
        require_free_space(workdir, listed, f"downloading {source.repo_id}")
        folder = hub.download_snapshot(source.repo_id, commit_sha, allow_patterns=CHECKPOINT_PATTERNS)
        # Cache snapshots are symlinks into the repo's blobs/ folder: confine to the repo folder.
        confine = _hub_confinement(folder)
        found = _walk_folder(folder, confine, source_label=params.source)
        metrics.update(
            repo_id=source.repo_id,
            requested_revision=source.revision or "main",
            **{SOURCE_REVISION_METRIC: commit_sha},
        )
    elif source.kind == "gguf":
        assert source.path is not None
        found = [(_checked_name(source.path.name, params.source), _confined(source.path, source.path.parent))]
    else:
        assert source.path is not None
        found = _walk_folder(source.path, source.path, source_label=params.source)
    taken = [(name, path) for name, path in found if is_checkpoint_file(name)]
    left_out = sorted(name for name, _ in found if not is_checkpoint_file(name))
    if hub_files is not None:
        for item in hub_files:
            _checked_name(item.name, params.source)  # a hostile listing is refused, not filtered
        left_out = sorted(set(left_out) | {f.name for f in hub_files if not is_checkpoint_file(f.name)})
        hub_files = [f for f in hub_files if is_checkpoint_file(f.name)]
    _refuse_unusable(params.source, taken, left_out)

    require_free_space(workdir, _bytes_to_copy(taken, workdir), f"the files of {params.source!r}")
    outputs, total_bytes, link_count = _materialise(taken, workdir / "snapshot")
    metrics.update(file_count=len(outputs), total_bytes=total_bytes, hardlinked_count=link_count,
                   left_out_count=len(left_out), left_out=left_out[:_MAX_LISTED])
    if hub_files is not None:
        outputs.append(_write_hub_files(workdir, metrics, hub_files))
        metrics["hub_sha256_count"] = sum(1 for item in hub_files if item.sha256)
    warnings: list[str] = []
    if hub_files == []:
        warnings.append("the hub gave no file listing (offline?); checksum cannot verify against hub sha256")
    if left_out:
        shown = ", ".join(left_out[:_MAX_LISTED]) + (" …" if len(left_out) > _MAX_LISTED else "")
        warnings.append(f"{len(left_out)} file(s) are not checkpoint files and were not taken: {shown}")
    return StageResult(outputs=tuple(outputs), metrics=metrics, warnings=tuple(warnings))


def _refuse_unusable(label: str, taken: list[tuple[str, Path]], left_out: list[str]) -> None:
    """Fail now when nothing usable remains, naming what was there instead."""
    if any(name.lower().endswith((".safetensors", ".gguf")) for name, _ in taken):
        return
    pickles = [name for name in left_out if name.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise InputError(
            f"source {label!r} is a pickle-only checkpoint ({', '.join(pickles[:5])}): pickle files can "
            "run arbitrary code when loaded and are never taken; provide safetensors weights (convert "
            "them in an isolated sandbox, or use the repo's safetensors revision)"
        )
    if not taken:
        found = ", ".join(left_out[:_MAX_LISTED]) or "none"
        raise InputError(
            f"source {label!r} holds no checkpoint files (weights, config, tokenizer); files found: {found}; "
            f"expected {ACCEPTED_FORMS}"
        )


def _hub_confinement(folder: Path) -> Path:
    """The folder that cache symlinks may point into: ``models--org--name`` for a cache snapshot."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots":
        return resolved.parent.parent
    return resolved


def _checked_name(name: str, source_label: str) -> str:
    try:
        return safe_relpath(name).as_posix()
    except InputError as exc:
        raise InputError(f"source {source_label!r}: {exc}") from exc


def _confined(path: Path, root: Path) -> Path:
    """Resolve `path` (following symlinks) and require a regular file inside `root`."""
    root_resolved = root.resolve()
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise InputError(f"{path}: broken or looping symlink ({exc}); refusing it") from exc
    if not target.is_relative_to(root_resolved):
        raise InputError(
            f"{path}: resolves to {target}, outside the source folder {root_resolved}; refusing it "
            "(symlinks must stay inside the snapshot)"
        )
    if not stat.S_ISREG(target.stat().st_mode):
        raise InputError(f"{path}: not a regular file (device, fifo or socket); refusing it")
    return target


def _walk_folder(folder: Path, confine: Path, *, source_label: str) -> list[tuple[str, Path]]:
    """(relative POSIX name, resolved path) of every file below `folder`, sorted by name."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in _JUNK_DIRS)
        for dirname in list(dirnames):
            if (here / dirname).is_symlink():
                # os.walk does not descend into linked folders; refuse escapes, skip the rest
                # (their content, if inside, is already listed under its real path).
                _confined_dir(here / dirname, confine)
                dirnames.remove(dirname)
        for filename in filenames:
            if filename in _JUNK_FILES:
                continue
            path = here / filename
            name = _checked_name(path.relative_to(folder).as_posix(), source_label)
            found.append((name, _confined(path, confine)))
    return sorted(found)


def _confined_dir(path: Path, root: Path) -> None:
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as exc:
        raise InputError(f"{path}: looping folder symlink ({exc}); refusing it") from exc
    if not target.is_relative_to(root.resolve()):
        raise InputError(
            f"{path}: folder symlink resolves to {target}, outside the source folder {root.resolve()}; "
            "refusing it"
        )
    logger.warning("download: skipping folder symlink %s (points inside the source)", path)


def _bytes_to_copy(found: list[tuple[str, Path]], workdir: Path) -> int:
    """Bytes that must be copied (not hard-linked: another file system) into the work folder."""
    device = os.stat(workdir).st_dev
    return sum(st.st_size for st in (path.stat() for _, path in found) if st.st_dev != device)


def _materialise(found: list[tuple[str, Path]], dest: Path) -> tuple[list[OutputFile], int, int]:
    """Hard-link (or copy) each file into `dest`; returns outputs, total bytes, hard-link count."""
    outputs: list[OutputFile] = []
    total_bytes = 0
    link_count = 0
    for name, src in found:
        dst = dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        expected_size = src.stat().st_size
        try:
            os.link(src, dst)
            link_count += 1
        except OSError:
            # Other file system, or hard links forbidden: copy under a temp name, then rename.
            with atomic_path(dst) as tmp:
                shutil.copyfile(src, tmp)
        actual_size = dst.stat().st_size
        if actual_size != expected_size:
            raise IntegrityError(
                f"{name}: copied {actual_size} bytes but the source has {expected_size}; "
                "the source changed during the download"
            )
        total_bytes += actual_size
        outputs.append(OutputFile(name=name, path=dst, kind="source-file", media_type=_media_type(name)))
    return outputs, total_bytes, link_count


def _media_type(name: str) -> str:
    if name.endswith(".json"):
        return "application/json"
    if name.endswith((".txt", ".md")) or name == "SHA256SUMS":
        return "text/plain"
    return "application/octet-stream"


def _write_hub_files(workdir: Path, metrics: Mapping[str, Any], hub_files: list[HubFile]) -> OutputFile:
    """Write the hub's per-file size and sha256 claims as ``hub_files.json``."""
    for item in hub_files:
        safe_relpath(item.name)
    document = {
        "repo_id": metrics["repo_id"],
        "revision": metrics[SOURCE_REVISION_METRIC],
        "files": [
            {"name": item.name, "size_bytes": item.size_bytes, "sha256": item.sha256}
            for item in sorted(hub_files, key=lambda entry: entry.name)
        ],
    }
    path = workdir / HUB_FILES_NAME
    write_json(path, document, indent=2, sort_keys=True)
    return OutputFile(name=HUB_FILES_NAME, path=path, kind="hub-metadata", media_type="application/json")
