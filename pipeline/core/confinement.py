"""Folders a submitter is confined to, shared by the source grammar and publish destinations.

A path is placed by its text first (``~`` and ``..`` applied, nothing opened), so a refusal tells
nothing about what exists outside; each root counts both as written and as resolved, so a root
reached through a symlink still holds what lies below it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["placed", "confinement_roots", "is_inside"]


def placed(text: str | Path) -> Path:
    """Where ``text`` names, by its text alone: absolute, ``~`` expanded, ``..`` applied."""
    return Path(os.path.abspath(os.path.expanduser(str(text))))


def confinement_roots(entries: Iterable[str | Path]) -> tuple[Path, ...]:
    """The non-empty ``entries``, each placed as written and as resolved, without repeats."""
    given = [placed(entry) for entry in entries if str(entry).strip()]
    return tuple(dict.fromkeys([*given, *(root.resolve() for root in given)]))


def is_inside(path: Path, roots: Iterable[Path]) -> bool:
    """Whether ``path`` is one of ``roots`` or lies below one."""
    return any(path.is_relative_to(root) for root in roots)
