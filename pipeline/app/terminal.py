"""Text from a job, made safe to print: a source, an error or a model card field came from a
submitter or a file, and a terminal obeys the escape sequences in what it is given (a title
change, a cleared screen, a forged prompt), as rich obeys ``[markup]``."""

from __future__ import annotations

from rich.markup import escape as _escape_markup

from pipeline.core.text import escape_unprintable

__all__ = ["printable", "markup_safe"]


def printable(text: object) -> str:
    """``text`` (None: empty) with every unprintable character written as its escape (``\\x1b``)."""
    return escape_unprintable("" if text is None else str(text))


def markup_safe(text: object) -> str:
    """`printable`, and rich's ``[markup]`` escaped: for text that rich prints."""
    return _escape_markup(printable(text))
