"""The validate stage's settings: every field a job option of the same name, checked before any run
(the probe's fields are `calibration.probe.ProbeSpec`'s, shared with calibrate)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.calibration.probe import DEFAULT_AGREEMENT_TEXT, ProbeSpec
from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.option_fields import option, read_fields
from pipeline.stages.base import JobSpec

__all__ = ["Params", "make_params", "ValidationFailed", "DEFAULT_AGREEMENT_TEXT"]


@dataclass(frozen=True)
class Params:
    """Validation settings: what llama.cpp is asked (``probe``, the very spec calibrate asked the
    source) and how the answers are judged; each field is also a job option of the same name.

    Agreement thresholds: ``pass`` needs top-1 agreement >= ``agreement_pass_top1`` and mean
    KL <= ``agreement_pass_kl`` (nats); ``fail`` is top-1 < ``agreement_fail_top1`` or KL >
    ``agreement_fail_kl``; anything between is a warning. Mainline CUDA has no TQ2_0 kernel, so
    the probe's default ``n_gpu_layers=0`` keeps llama.cpp on the CPU.
    """

    recipe: str = "tq2_0"
    probe: ProbeSpec = field(default_factory=ProbeSpec)
    n_threads: int = option(2, shown_default=None, help="llama.cpp threads (default: the cores, at most 4)",
                            low=1)
    expected: str = option("2", help="the answer `prompt` should start with")
    chat_expected: str = option("2", help="the answer `chat_prompt` should contain first")
    agreement_pass_top1: float = option(0.85, help="pass: top-1 agreement at least this", low=0, high=1)
    agreement_pass_kl: float = option(0.10, help="pass: mean KL (nats) at most this", low=0)
    agreement_fail_top1: float = option(0.50, help="fail: top-1 agreement below this", low=0, high=1)
    agreement_fail_kl: float = option(1.0, help="fail: mean KL (nats) above this", low=0)


class ValidationFailed(IntegrityError):
    """A check failed; ``metrics`` is the whole report, recorded on the failed attempt."""

    def __init__(self, message: str, metrics: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.metrics = dict(metrics)


def make_params(job: JobSpec) -> Params:
    """Params from the job's recipe and options (any `Params` or `ProbeSpec` field by name).

    Raises InputError for a value of the wrong kind, or thresholds out of order or range.
    """
    values: dict[str, Any] = {"recipe": job.recipe, "n_threads": min(4, os.cpu_count() or 1)}
    values.update(read_fields(Params, job.options, "validate", skip=("recipe",)))
    params = Params(probe=ProbeSpec.from_options(job.options), **values)
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
    return params
