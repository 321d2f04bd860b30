"""Text from a job, made safe to print: a source, an error or a model card field came from a
submitter or a file, and a terminal obeys the escape sequences in what it is given (a title
change, a cleared screen, a forged prompt), as rich obeys ``[markup]``."""

from __future__ import annotations

import unicodedata

from rich.markup import escape as _escape_markup

__all__ = ["printable", "markup_safe"]

# Controls, format characters (bidirectional overrides), surrogates, private use, line separators.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` with every unprintable character written as its escape (``\\x1b``, ``\\u202e``)."""
    value = "" if text is None else str(text)
    if not any(unicodedata.category(c) in _UNPRINTABLE for c in value):
        return value
    return "".join(
        c if unicodedata.category(c) not in _UNPRINTABLE or (keep_newlines and c == "\n")
        else ascii(c)[1:-1] for c in value
    )


def markup_safe(text: object, *, keep_newlines: bool = False) -> str:
    """`printable`, and rich's ``[markup]`` escaped: for text that rich prints."""
    return _escape_markup(printable(text, keep_newlines=keep_newlines))
