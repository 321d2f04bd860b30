"""The validate stage's settings: every field a job option of the same name, checked before any run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pipeline.core.errors import InputError, IntegrityError
from pipeline.stages.base import JobSpec

__all__ = ["Params", "make_params", "ValidationFailed", "DEFAULT_AGREEMENT_TEXT"]

# A few plain sentences: common words, no numbers or names a small model could not know.
DEFAULT_AGREEMENT_TEXT = (
    "The river runs through the old town and past the market square. Every morning the bakers "
    "open their doors, and the smell of fresh bread fills the street. Children walk to school "
    "while their parents hurry to work. In the evening the lamps are lit, and people meet their "
    "friends for dinner."
)


@dataclass(frozen=True)
class Params:
    """Validation settings; each field is also a job option of the same name.

    Agreement thresholds: ``pass`` needs top-1 agreement >= ``agreement_pass_top1`` and mean
    KL <= ``agreement_pass_kl`` (nats); ``fail`` is top-1 < ``agreement_fail_top1`` or KL >
    ``agreement_fail_kl``; anything between is a warning. ``n_gpu_layers=0`` keeps llama.cpp
    on the CPU (mainline CUDA has no TQ2_0 kernel); ``timeout_s`` bounds each llama.cpp run.
    """

    recipe: str = "tq2_0"
    n_ctx: int = 256
    n_threads: int = 2
    n_gpu_layers: int = 0
    seed: int = 0
    prompt: str = "1+1="
    expected: str = "2"
    chat_prompt: str = "What is 1+1?"
    chat_expected: str = "2"
    max_tokens: int = 16
    chat_max_tokens: int = 32
    agreement_text: str = DEFAULT_AGREEMENT_TEXT
    agreement_pass_top1: float = 0.85
    agreement_pass_kl: float = 0.10
    agreement_fail_top1: float = 0.50
    agreement_fail_kl: float = 1.0
    timeout_s: float = 300.0


class ValidationFailed(IntegrityError):
    """A check failed; ``metrics`` is the whole report, recorded on the failed attempt."""

    def __init__(self, message: str, metrics: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.metrics = dict(metrics)


def make_params(job: JobSpec) -> Params:
    """Params from the job's recipe and options (any `Params` field by name).

    Raises InputError for a value of the wrong kind, or thresholds out of order or range.
    """
    values: dict[str, Any] = {"recipe": job.recipe, "n_threads": min(4, os.cpu_count() or 1)}
    for item in fields(Params):
        if item.name == "recipe" or item.name not in job.options:
            continue
        raw = job.options[item.name]
        kind = type(getattr(Params(), item.name))
        try:
            values[item.name] = raw if kind is str and isinstance(raw, str) else kind(raw)
        except (TypeError, ValueError) as exc:
            raise InputError(f"validate option {item.name}={raw!r} is not a {kind.__name__}: {exc}") from exc
        if kind is str and not isinstance(raw, str):
            raise InputError(f"validate option {item.name}={raw!r} must be text")
    params = Params(**values)
    if not 0.0 <= params.agreement_fail_top1 <= params.agreement_pass_top1 <= 1.0:
        raise InputError(
            f"validate options: need 0 <= agreement_fail_top1 ({params.agreement_fail_top1}) <= "
            f"agreement_pass_top1 ({params.agreement_pass_top1}) <= 1"
        )
    if not 0.0 <= params.agreement_pass_kl <= params.agreement_fail_kl:
        raise InputError(
            f"validate options: need 0 <= agreement_pass_kl ({params.agreement_pass_kl}) <= "
            f"agreement_fail_kl ({params.agreement_fail_kl})"
        )
    if params.n_ctx < 16 or params.max_tokens < 1 or params.timeout_s <= 0:
        raise InputError(
            f"validate options: n_ctx {params.n_ctx} (>= 16), max_tokens {params.max_tokens} "
            f"(>= 1) and timeout_s {params.timeout_s} (> 0) are out of range"
        )
    return params
