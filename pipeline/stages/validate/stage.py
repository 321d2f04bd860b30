"""Validate stage: run the converted GGUF in llama.cpp and judge it against its source's stored answers.

Inputs: ``package/model.gguf``; ``decompose/report.json`` (what was decided); and the source's
side, ``calibrate/reference.npz``: the source's own answers to the same prompts and its next-token
log-probs on the agreement text, computed once per source by the calibrate stage. Validate runs
only the converted file; it never reads, converts or runs the source.

Output ``validation.json``, the same dict as the stage's metrics (so ``bonsai show --json``
carries it as "validation"): the verdict, ``checks`` (name -> pass / warn / fail),
``details`` (each check's reason and numbers), the texts, the agreement figures, the
source's own answers, the backend that ran and the parameters. The checks:

- ``loads``: llama.cpp opens the file and generates (fail otherwise);
- ``answer``: greedy ``1+1=`` completes with the expected answer first (warn otherwise: small
  or heavily compressed models may not know arithmetic); ``chat_answer``: the same for
  "What is 1+1?" through the file's chat template, when it has one;
- ``source_answer``: whether the source itself answers (so a missed answer can be blamed);
- ``repetition``: output collapsed into one token or a short loop: fail when the source does
  not loop on the same prompt (the conversion did it), warn when it does too or is absent;
- ``agreement``: top-1 next-token agreement and mean KL(source || converted) over a short
  built-in text; fail below the recipe's floor, or when the KL is no smaller than a uniform
  guess's (the model no longer predicts like its source);
- ``sparsity``: ternary tensors are not all ±1 (0% zeros: fail);
- ``bits_per_weight`` / ``tensor_types``: the file holds what decompose decided and the recipe
  asked for (named fallbacks make a warning).

Prompts, expected answers, context size, threads, GPU offload and the agreement thresholds
are job options (see `Params`). llama.cpp runs in child processes (`validation.probe`): a
broken file can abort the process that loads it, and that must fail this stage, not kill
the worker. Any failed check writes the report and raises `ValidationFailed`, which carries
the report as metrics so the failed attempt still shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.calibration.probe import ProbeProcess, ProbeRequest, ProbeResult
from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.verdicts import Verdict
from pipeline.formats.decompose_report import REPORT_NAME as DECOMPOSE_REPORT
from pipeline.formats.decompose_report import DecomposeReport
from pipeline.stages.base import (
    NO_CLIENTS,
    InputFile,
    MemoryNeed,
    OutputFile,
    StageClients,
    StageResult,
    input_size,
)
from pipeline.stages.validate import file_checks
from pipeline.stages.validate.judge import (
    Check,
    agreement_check,
    answer_check,
    exact_agreement,
    first_answer,
    quality_target_check,
    repetition_check,
    repetition_of,
    source_answer_check,
)
from pipeline.stages.validate.params import DEFAULT_AGREEMENT_TEXT, Params, ValidationFailed, make_params
from pipeline.stages.validate.report import REPORT_NAME, ValidationReport

if TYPE_CHECKING:
    from pipeline.calibration.reference import SourceReference

__all__ = [
    "NAME",
    "VERSION",
    "Params",
    "Check",
    "ValidationFailed",
    "ValidationReport",
    "make_params",
    "memory_need",
    "run",
    "repetition_of",
    "first_answer",
    "DEFAULT_AGREEMENT_TEXT",
]

NAME = "validate"
VERSION = "3"  # 3: repetition judged by token ids; scored against calibrate's source reference

log = logging.getLogger(__name__)


def _source(
    inputs: Mapping[str, InputFile], request: ProbeRequest
) -> tuple[ProbeResult | None, SourceReference | None, str, str]:
    """(the source's answers, its reference, the source's kind, why there is none) from calibrate."""
    from pipeline.calibration.answers import REFERENCE_NAME, SourceAnswers, request_key
    from pipeline.calibration.reference import read_reference

    item = inputs.get(f"calibrate/{REFERENCE_NAME}")
    if item is None:
        return None, None, "none", f"no source reference (calibrate/{REFERENCE_NAME}) was given"
    reference = read_reference(item.path)
    answers = SourceAnswers.from_info(reference.info)
    if dict(answers.request) != request_key(request):
        return None, None, answers.kind, (
            "the source reference was made for other prompts or another agreement text than this "
            "validation's; retry the job from calibrate"
        )
    return answers.probe, reference, answers.kind, ""


def _load_decompose_report(inputs: Mapping[str, InputFile]) -> DecomposeReport | None:
    label = f"decompose/{DECOMPOSE_REPORT}"
    item = inputs.get(label)
    return None if item is None else DecomposeReport.load(item.path, label)


def _is_exact_alone(inputs: Mapping[str, InputFile], decompose_report: DecomposeReport | None) -> bool:
    """Decompose proved the file bit-exact and calibrate was not needed (no source reference): the
    file is judged alone, its agreement with the source not measured."""
    from pipeline.calibration.answers import REFERENCE_NAME

    return f"calibrate/{REFERENCE_NAME}" not in inputs and bool(decompose_report and decompose_report.exact)


def _drop_logits(*probes: ProbeResult | None) -> None:
    for probe in probes:
        if probe and probe.logits_path:
            Path(probe.logits_path).unlink(missing_ok=True)


def _checks(
    candidate: ProbeResult,
    path: Path,
    summary: Any,
    params: Params,
    inputs: Mapping[str, InputFile],
    decompose_report: DecomposeReport | None,
) -> tuple[list[Check], dict[str, Any]]:
    """Every check after a successful load, and the source's side of the report."""
    source, reference, ref_kind, why = _source(inputs, params.probe.request(path, params.n_threads))
    try:
        checks = [
            answer_check(
                "answer",
                candidate.completions[0],
                params.expected,
                source.completions[0] if source else None,
            )
        ]
        if candidate.chat:
            checks.append(
                answer_check(
                    "chat_answer",
                    candidate.chat,
                    params.chat_expected,
                    source.chat if source else None,
                )
            )
        checks += [c for c in [source_answer_check(source, params)] if c is not None]
        alone = _is_exact_alone(inputs, decompose_report)
        agreement = exact_agreement() if alone else agreement_check(candidate, why, params, reference)
        checks += [repetition_check(candidate, source), agreement]
        checks += [c for c in [quality_target_check(agreement, decompose_report)] if c is not None]
    finally:
        _drop_logits(candidate)
    ternary_type = file_checks.recipe_ternary_type(params.recipe, decompose_report)
    checks += [
        file_checks.check_sparsity(path, decompose_report),
        file_checks.check_bits_per_weight(summary, ternary_type, decompose_report),
        file_checks.check_types(summary, ternary_type, decompose_report),
    ]
    side = {
        "kind": ref_kind,
        "error": why or None,
        "load_s": source.load_s if source else None,
        "completion": asdict(source.completions[0]) if source else None,
        "chat": asdict(source.chat) if source and source.chat else None,
    }
    return checks, side


def memory_need(params: Params, inputs: Mapping[str, InputFile]) -> MemoryNeed | None:
    """llama.cpp maps the converted file, all of it (what the user will run anyway), plus its context."""
    size = input_size(inputs, "package/")
    if not size:
        return None
    return MemoryNeed(size + (512 << 20), f"llama.cpp maps the converted file ({size / 1e9:.2f} GB) + 0.5 GB")


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    """Judge ``package/model.gguf``; writes validation.json, raises ValidationFailed on any failed check."""
    from pipeline.formats.gguf.readback import inspect_gguf

    item = inputs.get("package/model.gguf")
    if item is None:
        raise InputError(f"validate needs package/model.gguf; inputs were {sorted(inputs)}")
    workdir = Path(workdir)
    decompose_report = _load_decompose_report(inputs)  # read once: the request and the checks use it
    checks: list[Check] = []
    candidate: ProbeResult | None = None
    source: dict[str, Any] | None = None
    summary = None
    with ProbeProcess(workdir, label="converted") as child:  # llama.cpp loads while the file is read back
        try:
            summary = inspect_gguf(item.path)
        except IntegrityError as exc:
            checks.append(Check("loads", Verdict.FAIL, f"the file's GGUF structure is broken: {exc}"))
        if summary is not None:
            request = params.probe.request(item.path, params.n_threads)
            if _is_exact_alone(inputs, decompose_report):
                request = replace(request, text=None)  # nothing to score the text's logits against
            candidate, why = child.run(request, params.probe.timeout_s)
    if summary is not None:
        if candidate is None:
            checks.append(Check("loads", Verdict.FAIL, why))
        else:
            checks.append(
                Check(
                    "loads",
                    Verdict.PASS,
                    f"loaded in {candidate.load_s:.2f} s on {candidate.backend.device}",
                    {"load_s": candidate.load_s},
                )
            )
            more, source = _checks(candidate, item.path, summary, params, inputs, decompose_report)
            checks += more
    report = ValidationReport.build(params, item, summary, candidate, checks, source)
    path = workdir / REPORT_NAME
    report.write(path)
    log.info("validate: verdict %s; text %r; checks %s", report.verdict, report.text, dict(report.checks))
    if report.failed:
        # The report is on the failed attempt's metrics; the work folder (and this file) goes.
        raise ValidationFailed("validation failed: " + "; ".join(report.failed)
                               + " (the whole report: `bonsai show JOB --json`, under validation)",
                               report.to_dict())
    warnings = tuple(report.warned)
    return StageResult(
        outputs=(OutputFile(REPORT_NAME, path, "validation-report", "application/json"),),
        metrics=report.to_dict(),
        warnings=warnings,
    )
