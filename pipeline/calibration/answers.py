"""The calibrate stage's outputs as later stages read them: file names, and the source's answers.

``reference.npz`` (`calibration.reference`, kind ``source-reference``) always: the source's top-k
next-token log-probs (plus tail draws) on the agreement text, and on the calibration text when
statistics were collected. Its header's ``info["answers"]`` is a `SourceAnswers`: what the source
did in llama.cpp with the prompts validate judges ("1+1=", the chat question), exactly as
validate's own probe of a converted file reports it, and the request that produced it, so
validate can check the reference was made for its own prompts.

``imatrix.gguf`` (kind ``importance-matrix``, llama.cpp's imatrix format) and
``gram/blk.<i>.safetensors`` (kind ``gram-matrix``, `calibration.gram`) when the recipe asks.

Example::

    ref = read_reference(inputs["calibrate/reference.npz"].path)
    answers = SourceAnswers.from_info(ref.info)
    answers.probe.completions[0].text
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.calibration.probe import ProbeRequest, ProbeResult
from pipeline.core.errors import IntegrityError

__all__ = [
    "REFERENCE_NAME",
    "IMATRIX_NAME",
    "GRAM_PREFIX",
    "AGREEMENT",
    "CALIBRATION",
    "ANSWERS_FORMAT",
    "SourceAnswers",
    "request_key",
]

REFERENCE_NAME = "reference.npz"
IMATRIX_NAME = "imatrix.gguf"
GRAM_PREFIX = "gram/"
AGREEMENT = "agreement"  # the reference's sequence name for the agreement text
CALIBRATION = "calibration"
ANSWERS_FORMAT = "bonsai-source-answers/1"
_FIX = "retry the job from calibrate (`bonsai retry JOB --from calibrate`)"
# What of a probe request decides the source's answers (not the file path, not the thread count).
_REQUEST_FIELDS = ("prompts", "max_tokens", "chat_prompt", "chat_max_tokens", "text", "n_ctx", "seed")


def request_key(request: ProbeRequest) -> dict[str, Any]:
    """The parts of a probe request that decide what the model answers."""
    values = asdict(request)
    return {name: list(values[name]) if name == "prompts" else values[name] for name in _REQUEST_FIELDS}


@dataclass(frozen=True)
class SourceAnswers:
    """How the source was run: ``kind`` (``gguf-source``: the source file itself in llama.cpp;
    ``hf-16bit``: a 16-bit GGUF of the checkpoint in llama.cpp; ``torch-blockwise``: the checkpoint
    in torch one block at a time, `calibration.torch_collect`), the probe result (logits not kept:
    the reference holds them; None for ``torch-blockwise``, which makes the reference only and
    generates no answers), and the request's deciding fields (`request_key`)."""

    kind: str
    probe: ProbeResult | None
    request: Mapping[str, Any] = field(default_factory=dict)

    def to_info(self) -> dict[str, Any]:
        probe = None if self.probe is None else {**self.probe.to_document(), "logits_path": None}
        return {"format": ANSWERS_FORMAT, "kind": self.kind, "probe": probe, "request": dict(self.request)}

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> SourceAnswers:
        """The answers a reference's ``info`` carries; IntegrityError when absent or malformed."""
        document = info.get("answers")
        if not isinstance(document, Mapping) or document.get("format") != ANSWERS_FORMAT:
            raise IntegrityError(f"the source reference holds no {ANSWERS_FORMAT} answers; {_FIX}")
        try:
            made = document["probe"]
            # The reference holds the logits; a reference-only run (torch-blockwise) has no answers.
            probe = None if made is None else ProbeResult.from_document({**dict(made), "logits_path": None})
            return cls(kind=str(document["kind"]), probe=probe, request=dict(document.get("request") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"the source reference's answers are malformed ({exc!r}); {_FIX}") from exc
