"""The measured sensitivity (``sensitivity/sensitivity.json``): the KL each group step of the auto
recipe adds over a high-precision base, as llama.cpp measured it (`ternary.sensitivity`).

The contract between the sensitivity stage (which writes it once per source and ladder) and
decompose (which allocates every budget on it, and keeps a copy in its report's allocation). One
`load` (size-capped, IntegrityError naming the file and the fix) and one `write`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.files import write_json
from pipeline.formats.jsonfile import ShapeError, as_dataclass, load_json

__all__ = ["SENSITIVITY_FORMAT", "SENSITIVITY_NAME", "RETRY_SENSITIVITY", "SensitivityStep", "ChainStep",
           "SensitivitySummary"]

SENSITIVITY_FORMAT = "sensitivity/1"
SENSITIVITY_NAME = "sensitivity.json"
_MAX_BYTES = 16 * 1024 * 1024
RETRY_SENSITIVITY = "retry the job from sensitivity (`bonsai retry JOB --from sensitivity`)"


@dataclass(frozen=True)
class SensitivityStep:
    """One measured step: a group lowered ``depth`` hull rungs below the base (to ``types``), the
    bytes it saved, the proxy's cost rise for it and the KL it added over the base."""

    group: str
    depth: int
    types: tuple[str, ...]
    saved_bytes: int
    proxy: float
    kl_rise: float
    top1: float


@dataclass(frozen=True)
class ChainStep:
    """One step down the measured chain: ``group`` lowered to ``depth`` on top of every step before
    it, the bytes it saved, and the KL and top-1 of the file with all those steps (None past the
    point where the file broke and measuring stopped: there the order is the single steps')."""

    group: str
    depth: int
    saved_bytes: int
    kl: float | None
    top1: float | None


@dataclass(frozen=True)
class SensitivitySummary:
    """Measured sensitivity (`ternary.sensitivity`): the base file's agreement, every step, and the
    cost of measuring them (files run, seconds), on the first ``positions`` of ``scored_on``; and the
    chain: from the base down to every tensor's cheapest hull rung, one group step at a time, each
    the step that added least KL per byte on top of those before it (`ternary.sensitivity`)."""

    scored_on: str
    positions: int
    base_kl: float
    base_top1: float
    files: int
    seconds: float
    steps: tuple[SensitivityStep, ...]
    chain: tuple[ChainStep, ...] = ()

    def write(self, path: Path) -> str:
        """Write the summary atomically at `path`; returns the JSON text."""
        return write_json(path, {"format": SENSITIVITY_FORMAT, **asdict(self)}, indent=1, allow_nan=False)

    @classmethod
    def load(cls, path: Path, label: str = SENSITIVITY_NAME) -> SensitivitySummary:
        """Read a summary from `path` (at most 16 MB); IntegrityError naming `label` when it is not one."""
        document: Any = load_json(path, label, max_bytes=_MAX_BYTES, error=IntegrityError,
                                  fix=RETRY_SENSITIVITY)
        if not isinstance(document, dict) or document.pop("format", None) != SENSITIVITY_FORMAT:
            raise IntegrityError(f"{label}: not a {SENSITIVITY_FORMAT} document; {RETRY_SENSITIVITY}")
        try:
            return as_dataclass(cls, document)
        except ShapeError as exc:
            why = f"{label}: not a valid measured sensitivity ({exc}); {RETRY_SENSITIVITY}"
            raise IntegrityError(why) from None
