"""The validation report: the verdict, every check with its reason and numbers, what each model did.

One dataclass, one `load` (size-capped, IntegrityError naming the file) and one `write`. Its
dict (`to_dict`) is also the validate run's metrics, so ``bonsai show --json`` carries it as
"validation", on a failed attempt too. Keys are stable; new ones are only ever added.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.calibration.probe import ProbeResult
from pipeline.core.errors import IntegrityError
from pipeline.core.files import write_json
from pipeline.core.verdicts import Verdict
from pipeline.formats.jsonfile import load_json
from pipeline.stages.base import InputFile
from pipeline.stages.validate.judge import Check, first_answer, verdict_of
from pipeline.stages.validate.params import Params

__all__ = ["REPORT_FORMAT", "REPORT_NAME", "ValidationReport"]

REPORT_FORMAT = "validation-report/2"
REPORT_NAME = "validation.json"
_MAX_BYTES = 64 * 1024 * 1024
_FIX = "rerun validate (`bonsai retry JOB --from validate`)"


@dataclass(frozen=True)
class ValidationReport:
    """Everything validate found; see the stage's docstring for the checks."""

    verdict: str
    checks: Mapping[str, str]
    details: Mapping[str, Any]
    text: str | None
    n_tokens: int
    has_expected_answer: bool
    contains_expected: bool
    load_s: float | None
    tokens_per_s: float | None
    device: str | None
    backend: Mapping[str, Any] | None
    completion: Mapping[str, Any] | None
    chat: Mapping[str, Any] | None
    agreement: Mapping[str, Any] | None
    source: Mapping[str, Any] | None
    model: Mapping[str, Any]
    gguf: Mapping[str, Any] | None
    params: Mapping[str, Any]
    format: str = REPORT_FORMAT
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, params: Params, item: InputFile, summary: Any, candidate: ProbeResult | None,
              checks: list[Check], source: Mapping[str, Any] | None) -> ValidationReport:
        """The report of one validation run from its checks and what each model did."""
        completion = candidate.completions[0] if candidate else None
        text = completion.text if completion else None
        details = {c.name: {"verdict": c.verdict, "reason": c.reason, **(c.numbers or {})} for c in checks}
        chat: dict[str, Any] | None = None
        if candidate is not None:
            chat = asdict(candidate.chat) if candidate.chat else {
                "skipped": "the file has no tokenizer.chat_template"
                if not candidate.has_chat_template
                else "no chat prompt configured"
            }
        return cls(
            verdict=verdict_of(checks),
            checks={c.name: c.verdict for c in checks},
            details=details,
            text=text,
            n_tokens=len(completion.tokens) if completion else 0,
            has_expected_answer=bool(text is not None and first_answer(text) == params.expected),
            contains_expected=bool(text is not None and params.expected in text),
            load_s=candidate.load_s if candidate else None,
            tokens_per_s=completion.tokens_per_s if completion else None,
            device=candidate.backend.device if candidate else None,
            backend=asdict(candidate.backend) if candidate else None,
            completion=asdict(completion) if completion else None,
            chat=chat,
            agreement=details.get("agreement"),
            source=source,
            model={"name": item.name, "sha256": item.sha256, "size_bytes": item.size_bytes},
            gguf=None if summary is None else {
                "tensor_count": summary.tensor_count,
                "types": dict(summary.types),
                "bits_per_weight": round(summary.bits_per_weight, 4),
                "n_params": summary.n_params,
            },
            params=asdict(params),
        )

    @property
    def failed(self) -> list[str]:
        """``"name: reason"`` of every failed check."""
        return [f"{name}: {self.details[name]['reason']}"
                for name, v in self.checks.items() if v == Verdict.FAIL]

    @property
    def warned(self) -> list[str]:
        return [f"{name}: {self.details[name]['reason']}"
                for name, v in self.checks.items() if v == Verdict.WARN]

    def to_dict(self) -> dict[str, Any]:
        document = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        document.update(self.extra)
        return document

    def write(self, path: Path) -> str:
        """Write the report atomically at `path`; returns the JSON text."""
        return write_json(path, self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def load(cls, path: Path, label: str = REPORT_NAME) -> ValidationReport:
        """Read a report; IntegrityError naming `label` when it is not one this version writes."""
        document = load_json(path, label, max_bytes=_MAX_BYTES, error=IntegrityError, fix=_FIX)
        if not isinstance(document, Mapping) or document.get("format") != REPORT_FORMAT:
            raise IntegrityError(f"{label}: not a {REPORT_FORMAT} document; {_FIX}")
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = sorted(known - set(document) - {"format"})
        if missing:
            raise IntegrityError(f"{label}: lacks {', '.join(missing)}; {_FIX}")
        values = {name: document[name] for name in known if name in document}
        return cls(**values, extra={k: v for k, v in document.items() if k not in known})
