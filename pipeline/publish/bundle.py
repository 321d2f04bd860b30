"""Build the bundle folder: GGUF (whole or split), README.md, provenance.intoto.jsonl, SHA256SUMS."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.verdicts import Verdict
from pipeline.formats.gguf.split import split_gguf
from pipeline.publish.card import CardFile, render_card, summarise_gguf

__all__ = ["JobFacts", "Bundle", "build_bundle", "bundle_stem", "SUMS_NAME", "PROVENANCE_NAME"]

SUMS_NAME = "SHA256SUMS"
PROVENANCE_NAME = "provenance.intoto.jsonl"
CARD_NAME = "README.md"


@dataclass(frozen=True)
class JobFacts:
    """What the card says about the job; gathered from the database by `pipeline.app.publishing`.

    `validation_verdict` is the validate stage's verdict ("pass", "warn", "fail"), or
    "missing" when no validation finished.
    """

    job_id: int
    source: str
    resolved_revision: str | None
    recipe: str
    recipe_options: Mapping[str, Any]
    validation_verdict: str
    validation: Mapping[str, Any] | None = None
    statements: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    envelopes: Sequence[Mapping[str, Any]] = field(default_factory=tuple)

    @property
    def is_validated(self) -> bool:
        return self.validation_verdict in (Verdict.PASS, Verdict.WARN)


@dataclass(frozen=True)
class Bundle:
    """The folder written and its files (name -> sha256), SHA256SUMS excluded."""

    folder: Path
    files: Mapping[str, str]
    gguf_files: Sequence[str]
    is_split: bool


def bundle_stem(facts: JobFacts) -> str:
    """A file-name stem from the source's last path part and the recipe: `tiny-llama-tq2_0`."""
    tail = facts.source.split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1] or f"job{facts.job_id}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{tail}-{facts.recipe}").strip("-.")


def build_bundle(facts: JobFacts, gguf_path: Path, dest: Path, *, split_max_bytes: int | None = None,
                 is_forced: bool = False) -> Bundle:
    """Write the bundle of `facts`' GGUF into `dest` (new or empty); the GGUF is split when it is
    larger than `split_max_bytes`.

    Raises InputError when validation did not pass and `is_forced` is not set, or when
    `dest` holds files (a bundle is never written over another).
    """
    if not facts.is_validated and not is_forced:
        raise InputError(
            f"job {facts.job_id}: validation {facts.validation_verdict}; publishing it anyway needs --force "
            "(the model card will say it failed)"
        )
    dest = _new_folder(Path(dest))
    stem = bundle_stem(facts)
    gguf_sha256 = _sha256(gguf_path)
    is_split = split_max_bytes is not None and gguf_path.stat().st_size > split_max_bytes
    if is_split:
        assert split_max_bytes is not None
        ggufs = split_gguf(gguf_path, dest, stem, split_max_bytes)
    else:
        ggufs = [dest / f"{stem}.gguf"]
        _copy_or_link(gguf_path, ggufs[0])
    provenance = dest / PROVENANCE_NAME
    lines = [json.dumps(item, sort_keys=True, separators=(",", ":")) for item in [*facts.statements,
                                                                                  *facts.envelopes]]
    _create(provenance, "".join(f"{line}\n" for line in lines))
    files = {path.name: _sha256(path) for path in [*ggufs, provenance]}
    card_files = [CardFile(p.name, p.stat().st_size, files[p.name]) for p in ggufs]
    card = render_card(facts, summarise_gguf(gguf_path), card_files, gguf_sha256, files[PROVENANCE_NAME],
                       is_forced)
    _create(dest / CARD_NAME, card)
    files[CARD_NAME] = _sha256(dest / CARD_NAME)
    _create(dest / SUMS_NAME, "".join(f"{sha}  {name}\n" for name, sha in sorted(files.items())))
    return Bundle(dest, dict(sorted(files.items())), [p.name for p in ggufs], is_split)


def _new_folder(dest: Path) -> Path:
    """Make ``dest`` (its missing parents too) and return it; an existing empty folder is taken over
    only by removing and making it again, so every bundle lands in a folder it made itself."""
    try:
        if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
            dest.rmdir()
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.mkdir()
    except FileExistsError:
        raise InputError(f"{dest} is not empty; publish into a new folder "
                         "(bundles are never overwritten)") from None
    except OSError as exc:
        raise InputError(f"cannot make the bundle folder {dest}: {exc.strerror}; choose another") from exc
    return dest


# A new file only: never through a symlink, never over a file (another writer in the folder loses).
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _create(path: Path, text: str) -> None:
    with os.fdopen(os.open(path, _CREATE_FLAGS, 0o644), "w", encoding="utf-8") as handle:
        handle.write(text)


def _copy_or_link(source: Path, dest: Path) -> None:
    # A hard link costs nothing; the store's file is read-only, so the bundle's copy cannot change it.
    # os.link never follows or replaces what is at ``dest``.
    try:
        os.link(source, dest)
    except FileExistsError:
        raise
    except OSError:
        with open(source, "rb") as src, os.fdopen(os.open(dest, _CREATE_FLAGS, 0o644), "wb") as out:
            shutil.copyfileobj(src, out, 1 << 24)


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
