"""Where `bonsai convert` and `bonsai export` put the GGUF a user takes away, under a readable name.

The store keeps every file by digest (``artifacts/sha256/eb/ebe6…``); people get a copy named
``<model>-<TYPE>.gguf`` (``tiny-llama-TQ2_0.gguf``) in the current folder, in a folder given
as ``--out``, or at the exact ``--out`` file. A copy never replaces a file unless ``force``:
a default name takes the first free ``-2``, ``-3`` … suffix, an explicit file is refused.
`plan` checks the destination before any work; `deliver` writes it atomically.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.files import atomic_path

__all__ = ["OutputPlan", "plan", "deliver", "default_name", "validation_failed"]


@dataclass(frozen=True)
class OutputPlan:
    """A destination: ``file`` exactly, or a free default name inside ``folder``."""

    folder: Path
    file: Path | None = None
    force: bool = False


def default_name(model_name: str, ternary_type: str) -> str:
    """``<model>-<TYPE>.gguf``, with path separators in the model name replaced."""
    safe = model_name.replace("/", "-").replace(os.sep, "-").strip(". ") or "model"
    return f"{safe}-{ternary_type.upper()}.gguf"


def plan(given: str | None, force: bool, default_folder: Path) -> OutputPlan:
    """Check `given` (None: `default_folder`; an existing folder or text ending in ``/``: a folder) now,
    before any job runs; InputError naming the path and the fix."""
    if given is None:
        return _checked(OutputPlan(default_folder, None, force))
    out = Path(given)
    if out.is_dir() or given.endswith(("/", os.sep)):
        return _checked(OutputPlan(out, None, force))
    if out.exists() and not force:
        raise InputError(f"--out {out} already exists; choose a new path, or add --force to replace it")
    if out.exists() and not out.is_file():
        raise InputError(f"--out {out} exists and is not a file; choose another path")
    return _checked(OutputPlan(out.parent, out, force))


def _checked(target: OutputPlan) -> OutputPlan:
    """Refuse a folder that can never be made: an ancestor that is a file, or one not writable."""
    folder = target.folder
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise InputError(f"cannot write into {folder}: {existing} is a file, not a folder")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"cannot write into {folder}: {existing} is not writable")
    return target


def deliver(target: OutputPlan, source: Path, name: str) -> Path:
    """Copy `source` to the planned place (missing folders made); returns the absolute path written."""
    target.folder.mkdir(parents=True, exist_ok=True)
    dest = target.file or _free_name(target.folder / name, target.force)
    with atomic_path(dest, overwrite=target.force) as tmp:
        shutil.copyfile(source, tmp)
    return dest.absolute()


def _free_name(wanted: Path, force: bool) -> Path:
    if force or not wanted.exists():
        return wanted
    stem, suffix = wanted.name.removesuffix(".gguf"), ".gguf"
    for number in range(2, 10_000):
        candidate = wanted.with_name(f"{stem}-{number}{suffix}")
        if not candidate.exists():
            return candidate
    raise InputError(f"{wanted.parent} already holds {stem}-2 … {stem}-9999{suffix}; use --out")


def validation_failed(detail: Mapping[str, Any]) -> bool:
    """True when a job view (`views.job_detail`) has a packaged GGUF and its newest validation failed."""
    latest = [r for r in detail["stages"] if r["stage"] == "validate" and not r["shard"]]
    return bool(detail["gguf"]) and bool(latest) and latest[-1]["status"] == "failed"
