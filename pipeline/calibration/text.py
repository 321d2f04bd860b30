"""Calibration text: the built-in one shipped with the package, or a user's file.

The built-in text (``data/calibration.txt``, written for this project, Apache-2.0; see
``data/README.md``) mixes prose, dialogue, code, numbers and seventeen languages, about
4,400 Gemma 3 tokens. A calibration text must not contain the text validation judges
agreement on: `find_shared_run` finds a run of words two texts share, and
`check_disjoint` refuses a calibration text that holds one.

Example::

    text = builtin_text()
    check_disjoint(read_calibration_file(path), DEFAULT_AGREEMENT_TEXT, min_words=8)
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

from pipeline.core.errors import InputError

__all__ = [
    "BUILTIN_NAME",
    "MAX_CALIBRATION_BYTES",
    "builtin_text",
    "text_sha256",
    "read_calibration_file",
    "find_shared_run",
    "check_disjoint",
]

BUILTIN_NAME = "bonsai-builtin-calibration-v1"  # recorded as the imatrix dataset name
# A calibration run is a forward pass per token: 16 MiB of text is millions of tokens,
# far past what improves the statistics and a sign the wrong file was given.
MAX_CALIBRATION_BYTES = 16 * 1024 * 1024
_WORD = re.compile(r"\w+", re.UNICODE)


@lru_cache(maxsize=1)
def builtin_text() -> str:
    """The built-in calibration text (UTF-8, ~15,500 characters)."""
    return resources.files("pipeline.calibration").joinpath("data/calibration.txt").read_text("utf-8")


def text_sha256(text: str) -> str:
    """Hex sha256 of the text's UTF-8 bytes: what a cache key records for it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_calibration_file(path: Path) -> str:
    """A user's calibration text. Raises InputError when it is missing, empty, too large or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"calibration file {path} does not exist or is not a file")
    size = path.stat().st_size
    if size > MAX_CALIBRATION_BYTES:
        raise InputError(
            f"calibration file {path} is {size} bytes; the limit is {MAX_CALIBRATION_BYTES} "
            "(a few thousand to a few hundred thousand tokens is what calibration needs)"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"calibration file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from exc
    if not text.strip():
        raise InputError(f"calibration file {path} holds no text")
    return text


def _words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


def find_shared_run(text: str, other: str, min_words: int) -> str | None:
    """The first run of ``min_words`` consecutive words (case-folded, punctuation ignored) that both
    texts contain, joined by spaces, or None."""
    if min_words < 1:
        raise ValueError(f"min_words must be >= 1, got {min_words}")
    theirs = _words(other)
    grams = {tuple(theirs[i : i + min_words]) for i in range(len(theirs) - min_words + 1)}
    mine = _words(text)
    for i in range(len(mine) - min_words + 1):
        gram = tuple(mine[i : i + min_words])
        if gram in grams:
            return " ".join(gram)
    return None


def check_disjoint(calibration: str, agreement: str, min_words: int = 8) -> None:
    """Raise InputError when the calibration text contains a run of ``min_words`` words of the agreement
    text: calibrating on the text that judges the result would flatter it."""
    shared = find_shared_run(calibration, agreement, min_words)
    if shared is not None:
        raise InputError(
            f"the calibration text contains {shared!r}, {min_words} words of the agreement text validation "
            "judges the conversion on; remove that passage or choose another agreement text"
        )
