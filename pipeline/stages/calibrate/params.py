"""The calibrate stage's settings, from the job's recipe and options, checked before any run.

Options it reads (shared with other stages by name):

- ``importance``: ``none`` (default) or ``imatrix``: collect the importance matrix (mean x² per
  input column of every block weight) for decompose's importance-weighted fit;
- ``method``: ``gptq`` also collects the input Gram matrices XᵀX that fit needs;
- ``calibration_text``: the calibration text itself (``bonsai convert/submit --calibration FILE``
  reads a file into it; at most `MAX_INLINE_BYTES`); empty: the built-in text. It must share no run
  of eight words with the agreement text;
- ``calibration_ctx``: tokens per calibration sequence (default 512, as llama-imatrix);
- ``reference_top_k`` / ``reference_tail_samples``: how much of each source distribution the
  reference keeps (`calibration.reference`);
- the llama.cpp probe's options (`calibration.probe.ProbeSpec`: ``prompt``, ``chat_prompt``,
  ``max_tokens``, ``chat_max_tokens``, ``agreement_text``, ``n_ctx``, ``n_gpu_layers``, ``seed``,
  ``timeout_s``), read by the same spec validate reads: the source answers exactly what validate
  will ask the conversion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.calibration.probe import ProbeSpec
from pipeline.calibration.text import BUILTIN_NAME, builtin_text, check_disjoint, text_sha256
from pipeline.core.errors import InputError
from pipeline.core.option_fields import option, read_fields
from pipeline.stages.base import JobSpec
from pipeline.stages.calibrate.engines import ENGINES
from pipeline.ternary.policy import importance_for

__all__ = ["Params", "make_params", "IMPORTANCE_KINDS", "MAX_INLINE_BYTES", "needs_statistics"]

IMPORTANCE_KINDS = ("none", "imatrix")
# The text travels inside the job's options (and the stage's recorded parameters): 1 MiB is about
# 250,000 tokens, past what improves the statistics.
MAX_INLINE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Params:
    """What the source is run on and what is kept; see the module docstring for each option."""

    probe: ProbeSpec = field(default_factory=ProbeSpec)
    importance: str = option("none", choices=IMPORTANCE_KINDS, help="imatrix: fit each block weighted by the "
                             "calibration activations (llama.cpp's imatrix, written as imatrix.gguf)")
    is_gram: bool = False
    calibration_text: str = option("", shown_default=None, help="the calibration text itself (the CLI's "
                                   "--calibration FILE fills it; default: the built-in text)")
    calibration_ctx: int = option(512, help="tokens per calibration sequence", low=16, high=8192)
    top_k: int = option(64, key="reference_top_k", help="source log-probs kept per position for validate",
                        low=1, high=4096)
    tail_samples: int = option(64, key="reference_tail_samples",
                               help="tail draws per position for the KL estimate", low=1, high=4096)
    engine: str = option("auto", key="reference_engine", choices=ENGINES,
                         help="how the source runs: llama (llama.cpp, the whole model; also answers the "
                         "prompts), torch (one block at a time: memory flat in model size), auto (the one "
                         "whose estimate from the model card needs less memory; llama on a tie)")

    @property
    def is_statistics(self) -> bool:
        """Whether the source runs over the calibration text at all."""
        return self.importance != "none" or self.is_gram

    @property
    def text(self) -> str:
        """The calibration text: the job's own, or the built-in one."""
        return self.calibration_text or builtin_text()

    @property
    def dataset_name(self) -> str:
        """The name the imatrix records for the text."""
        if not self.calibration_text:
            return BUILTIN_NAME
        return f"user-calibration-{text_sha256(self.calibration_text)[:16]}"


def needs_statistics(options: dict[str, Any] | Any) -> bool:
    """Whether a job's options ask for calibration statistics (importance matrix or Gram matrices)."""
    return options.get("importance", "none") not in (None, "none") or options.get("method") == "gptq"


def _calibration_text(options: Any) -> str:
    text = options.get("calibration_text", "") or ""
    if not isinstance(text, str):
        raise InputError("calibrate option calibration_text must be text (use --calibration FILE)")
    size = len(text.encode("utf-8"))
    if size > MAX_INLINE_BYTES:
        raise InputError(
            f"the calibration text is {size} bytes; the limit is {MAX_INLINE_BYTES} "
            "(about 250,000 tokens, more than calibration needs): shorten the file"
        )
    if text and not text.strip():
        raise InputError("the calibration text holds no text; give a file with some, or none (built-in)")
    return text


def make_params(job: JobSpec) -> Params:
    """Params from the job's options; InputError for an unknown importance kind, a bad number, or a
    calibration text that contains a passage of the agreement text."""
    options = job.options
    importance = importance_for(job.recipe, options)
    if importance not in IMPORTANCE_KINDS:
        raise InputError(f"option importance={importance!r}; expected one of {', '.join(IMPORTANCE_KINDS)}")
    params = Params(
        probe=ProbeSpec.from_options(options),  # the very prompts and text validate will ask
        importance=str(importance),
        is_gram=options.get("method") == "gptq",
        calibration_text=_calibration_text(options),
        **read_fields(Params, options, "calibrate", skip=("importance", "calibration_text")),
    )
    if params.is_statistics and params.probe.agreement_text:
        check_disjoint(params.text, params.probe.agreement_text)
    return params
