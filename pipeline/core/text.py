"""Unprintable characters: the one definition of what a source, a destination or a job's text may
not carry raw. Controls (terminal escapes), format characters (bidirectional overrides), surrogates,
private use and line separators; `escape_unprintable` writes them as Python escapes."""

from __future__ import annotations

import unicodedata

__all__ = ["UNPRINTABLE_CATEGORIES", "first_unprintable", "escape_unprintable"]

UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})


def first_unprintable(text: str) -> str | None:
    """The first unprintable character of ``text``, or None."""
    return next((c for c in text if unicodedata.category(c) in UNPRINTABLE_CATEGORIES), None)


def escape_unprintable(text: str) -> str:
    """``text`` with every unprintable character written as its escape (``\\x1b``, ``\\u202e``)."""
    if first_unprintable(text) is None:
        return text
    return "".join(ascii(c)[1:-1] if unicodedata.category(c) in UNPRINTABLE_CATEGORIES else c for c in text)
