"""The one vocabulary of judgements: a validation check's verdict and a whole validation's."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

__all__ = ["Verdict"]


class Verdict(StrEnum):
    """``pass``: fine; ``warn``: usable, with a reason to look; ``fail``: not usable."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"

    @classmethod
    def worst(cls, verdicts: Iterable[str]) -> Verdict:
        """The worst of ``verdicts`` (pass when there are none)."""
        found = {cls(v) for v in verdicts}
        return next((v for v in (cls.FAIL, cls.WARN) if v in found), cls.PASS)
