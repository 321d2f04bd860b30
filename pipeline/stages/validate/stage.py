"""Validate stage: run the converted GGUF in llama.cpp next to its source and judge the result.

Inputs: ``package/model.gguf``; ``decompose/report.json`` (what was decided); and the source:
``inspect/model_card.json`` with the ``download/*`` files. The source is run as a GGUF too:
a GGUF source as it is, an HF checkpoint as a 16-bit GGUF built here from the same tensors
decompose read, under the converted file's metadata (`validation.reference`).

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

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError, IntegrityError, PipelineError
from pipeline.core.files import write_json
from pipeline.formats.model_card import ModelCard
from pipeline.stages.base import InputFile, JobSpec, OutputFile, StageResult, inputs_of
from pipeline.stages.validate.judge import Check, first_answer, repetition_of, verdict_of

__all__ = [
    "NAME",
    "VERSION",
    "Params",
    "Check",
    "ValidationFailed",
    "make_params",
    "run",
    "repetition_of",
    "first_answer",
    "DEFAULT_AGREEMENT_TEXT",
]

NAME = "validate"
VERSION = "2"
OUTPUT_NAME = "validation.json"
REPORT_FORMAT = "validation-report/2"

log = logging.getLogger(__name__)

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


# --- running both models ------------------------------------------------------------------------


def _request(path: Path, params: Params) -> Any:
    from pipeline.stages.validate.probe import ProbeRequest

    return ProbeRequest(
        path=str(path),
        prompts=(params.prompt,),
        max_tokens=params.max_tokens,
        chat_prompt=params.chat_prompt or None,
        chat_max_tokens=params.chat_max_tokens,
        text=params.agreement_text or None,
        n_ctx=params.n_ctx,
        n_threads=params.n_threads,
        n_gpu_layers=params.n_gpu_layers,
        seed=params.seed,
    )


def _reference(
    inputs: Mapping[str, InputFile], converted: Path, workdir: Path
) -> tuple[Path | None, str, str]:
    """(path of the source as GGUF or None, its kind, why there is none)."""
    from pipeline.stages.validate.reference import build_reference

    card_item = inputs.get("inspect/model_card.json")
    download = {name: item.path for name, item in inputs_of(inputs, "download").items()}
    if card_item is None or not download:
        return None, "none", "no source inputs (inspect/model_card.json, download/*) were given"
    card = ModelCard.load(card_item.path, "inspect/model_card.json")
    if card.is_gguf:
        shard = card.shards[0] if card.shards else ""
        if shard not in download:
            return None, "gguf-source", f"the source file {shard!r} is not among the inputs"
        return download[shard], "gguf-source", ""
    try:
        return build_reference(card, download, converted, workdir / ".reference.gguf"), "hf-16bit", ""
    except PipelineError as exc:
        return None, "hf-16bit", f"could not build the 16-bit reference from the source: {exc}"


def _agreement(
    candidate: Mapping[str, Any], source: Mapping[str, Any] | None, source_why: str, params: Params
) -> Check:
    """Top-1 agreement and mean KL over the built-in text, judged against the thresholds."""
    import numpy as np

    from pipeline.stages.validate.judge import agreement_stats

    if source is None:
        return Check("agreement", "warn", f"agreement with the source not measured: {source_why}")
    if not params.agreement_text:
        return Check("agreement", "warn", "agreement not measured: the agreement text option is empty")
    if candidate["n_vocab"] != source["n_vocab"]:
        return Check(
            "agreement",
            "fail",
            f"vocabularies differ: source {source['n_vocab']} tokens, converted {candidate['n_vocab']}",
            {"n_vocab": [source["n_vocab"], candidate["n_vocab"]]},
        )
    ids_src, ids_cand = source["text"]["tokens"], candidate["text"]["tokens"]
    if ids_src != ids_cand:
        first = next(
            (i for i, (a, b) in enumerate(zip(ids_src, ids_cand, strict=False)) if a != b),
            min(len(ids_src), len(ids_cand)),
        )
        return Check(
            "agreement",
            "fail",
            f"the tokenizers disagree on the agreement text: source "
            f"{len(ids_src)} tokens, converted {len(ids_cand)}, first difference at token {first}",
        )
    stats = agreement_stats(np.load(source["logits_path"]), np.load(candidate["logits_path"]), ids_src)
    numbers = {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(stats).items()}
    numbers["is_text_truncated"] = bool(source["text"]["is_truncated"])
    detail = (
        f"top-1 agreement {stats.top1_agreement:.1%}, mean KL {stats.mean_kl:.3f} nats over "
        f"{stats.n_positions} positions of the agreement text (log-perplexity source "
        f"{stats.source_nll:.2f}, converted {stats.candidate_nll:.2f}; a model that knows nothing "
        f"would be at KL {stats.uniform_kl:.2f})"
    )
    if stats.mean_kl >= stats.uniform_kl > 0.0:
        # Scale-free floor: a near-uniform source (random weights) makes any absolute KL look small.
        return Check(
            "agreement",
            "fail",
            f"{detail}: no closer to the source than a model that knows "
            "nothing; the converted model no longer predicts like its source",
            numbers,
        )
    if stats.top1_agreement < params.agreement_fail_top1 or stats.mean_kl > params.agreement_fail_kl:
        return Check(
            "agreement",
            "fail",
            f"{detail}: below the floor (top-1 >= "
            f"{params.agreement_fail_top1:.0%} and KL <= {params.agreement_fail_kl:g}); the converted "
            "model no longer predicts like its source",
            numbers,
        )
    if stats.top1_agreement < params.agreement_pass_top1 or stats.mean_kl > params.agreement_pass_kl:
        return Check(
            "agreement",
            "warn",
            f"{detail}: short of a pass (top-1 >= {params.agreement_pass_top1:.0%} "
            f"and KL <= {params.agreement_pass_kl:g})",
            numbers,
        )
    return Check("agreement", "pass", detail, numbers)


# --- behaviour checks ---------------------------------------------------------------------------


def _answer(
    name: str, out: Mapping[str, Any] | None, expected: str, source_out: Mapping[str, Any] | None
) -> Check:
    text = out["text"] if out else ""
    found = first_answer(text)
    source_found = first_answer(source_out["text"]) if source_out else None
    numbers = {
        "prompt": out["prompt"] if out else None,
        "text": text,
        "first_number": found,
        "expected": expected,
        "source_text": source_out["text"] if source_out else None,
        "source_first_number": source_found,
    }
    # The first number must be the answer: "12" or "3, 2" contain "2" but are wrong.
    if found == expected:
        return Check(name, "pass", f"{numbers['prompt']!r} -> {text!r} answers {expected!r}", numbers)
    blame = (
        f"; the source answers {source_found!r}, so the conversion lost it"
        if source_found == expected
        else "; the source does not answer it either"
        if source_out
        else ""
    )
    return Check(
        name,
        "warn",
        f"{numbers['prompt']!r} -> {text!r}: first number {found!r}, expected {expected!r}{blame}",
        numbers,
    )


def _source_answer(source: Mapping[str, Any] | None, params: Params) -> Check | None:
    if source is None:
        return None
    out = source["completions"][0]
    found = first_answer(out["text"])
    numbers = {
        "prompt": out["prompt"],
        "text": out["text"],
        "first_number": found,
        "expected": params.expected,
    }
    if found == params.expected:
        return Check(
            "source_answer", "pass", f"the source answers: {out['prompt']!r} -> {out['text']!r}", numbers
        )
    return Check(
        "source_answer",
        "warn",
        f"the source itself does not answer {params.expected!r}: "
        f"{out['prompt']!r} -> {out['text']!r}; the answer checks say little about the conversion",
        numbers,
    )


def _outputs(probe: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    found = {"completion": probe["completions"][0]}
    if probe.get("chat"):
        found["chat"] = probe["chat"]
    return found


def _repetition(candidate: Mapping[str, Any], source: Mapping[str, Any] | None) -> Check:
    loops = {
        kind: repetition_of(list(out["tokens"]), out["text"]) for kind, out in _outputs(candidate).items()
    }
    loops = {kind: why for kind, why in loops.items() if why}
    if not loops:
        return Check("repetition", "pass", "no degenerate loop in the generated text", {"loops": {}})
    source_loops = {}
    if source is not None:
        source_loops = {
            kind: repetition_of(list(out["tokens"]), out["text"]) for kind, out in _outputs(source).items()
        }
    numbers = {"loops": loops, "source_loops": {k: v for k, v in source_loops.items() if v}}
    listed = "; ".join(f"{kind}: {why}" for kind, why in loops.items())
    if source is None:
        return Check("repetition", "warn", f"{listed} (no source run to compare with)", numbers)
    introduced = [kind for kind in loops if not source_loops.get(kind)]
    if introduced:
        return Check(
            "repetition",
            "fail",
            f"{listed}; the source does not loop there, so the conversion broke it",
            numbers,
        )
    return Check("repetition", "warn", f"{listed}; the source loops the same way", numbers)


# --- stage ---------------------------------------------------------------------------------------


def _load_report(inputs: Mapping[str, InputFile]) -> dict[str, Any] | None:
    item = inputs.get("decompose/report.json")
    if item is None:
        return None
    try:
        report = json.loads(item.path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"decompose/report.json is not readable JSON: {exc}") from exc
    return report if isinstance(report, dict) else None


def _write_report(workdir: Path, report: Mapping[str, Any]) -> Path:
    dest = workdir / OUTPUT_NAME
    write_json(dest, report, indent=1, sort_keys=True)
    return dest


def _drop_logits(*probes: Mapping[str, Any] | None) -> None:
    for probe in probes:
        if probe and probe.get("logits_path"):
            Path(probe["logits_path"]).unlink(missing_ok=True)


def _checks(
    candidate: dict[str, Any],
    path: Path,
    summary: Any,
    params: Params,
    inputs: Mapping[str, InputFile],
    workdir: Path,
) -> tuple[list[Check], dict[str, Any]]:
    """Every check after a successful load, and the source's side of the report."""
    from pipeline.stages.validate import file_checks
    from pipeline.stages.validate.probe import run_probe

    decompose_report = _load_report(inputs)
    ref_path, ref_kind, why = _reference(inputs, path, workdir)
    source: dict[str, Any] | None = None
    if ref_path is not None:
        source, why = run_probe(_request(ref_path, params), workdir, params.timeout_s, label="source")
    try:
        checks = [
            _answer(
                "answer",
                candidate["completions"][0],
                params.expected,
                source["completions"][0] if source else None,
            )
        ]
        if candidate.get("chat"):
            checks.append(
                _answer(
                    "chat_answer",
                    candidate["chat"],
                    params.chat_expected,
                    source.get("chat") if source else None,
                )
            )
        checks += [c for c in [_source_answer(source, params)] if c is not None]
        checks += [_repetition(candidate, source), _agreement(candidate, source, why, params)]
    finally:
        _drop_logits(candidate, source)
        (workdir / ".reference.gguf").unlink(missing_ok=True)
    ternary_type = file_checks.recipe_ternary_type(params.recipe, decompose_report)
    checks += [
        file_checks.check_sparsity(path, decompose_report),
        file_checks.check_bits_per_weight(summary, ternary_type, decompose_report),
        file_checks.check_types(summary, ternary_type, decompose_report),
    ]
    side = {
        "kind": ref_kind,
        "error": why or None,
        "load_s": source["load_s"] if source else None,
        "completion": source["completions"][0] if source else None,
        "chat": source.get("chat") if source else None,
    }
    return checks, side


def _report(
    params: Params,
    item: InputFile,
    summary: Any,
    candidate: dict[str, Any] | None,
    checks: list[Check],
    source: Mapping[str, Any] | None,
) -> dict[str, Any]:
    verdict = verdict_of(checks)
    completion = candidate["completions"][0] if candidate else None
    text = completion["text"] if completion else None
    details = {c.name: {"verdict": c.verdict, "reason": c.reason, **(c.numbers or {})} for c in checks}
    chat: dict[str, Any] | None = None
    if candidate is not None:
        chat = candidate["chat"] or {
            "skipped": "the file has no tokenizer.chat_template"
            if not candidate["has_chat_template"]
            else "no chat prompt configured"
        }
    return {
        "format": REPORT_FORMAT,
        "verdict": verdict,
        "checks": {c.name: c.verdict for c in checks},
        "details": details,
        "text": text,
        "n_tokens": len(completion["tokens"]) if completion else 0,
        "has_expected_answer": bool(text is not None and first_answer(text) == params.expected),
        "contains_expected": bool(text is not None and params.expected in text),
        "load_s": candidate["load_s"] if candidate else None,
        "tokens_per_s": completion["tokens_per_s"] if completion else None,
        "device": candidate["backend"]["device"] if candidate else None,
        "backend": candidate["backend"] if candidate else None,
        "completion": completion,
        "chat": chat,
        "agreement": details.get("agreement"),
        "source": source,
        "model": {"name": item.name, "sha256": item.sha256, "size_bytes": item.size_bytes},
        "gguf": None
        if summary is None
        else {
            "tensor_count": summary.tensor_count,
            "types": dict(summary.types),
            "bits_per_weight": round(summary.bits_per_weight, 4),
            "n_params": summary.n_params,
        },
        "params": asdict(params),
    }


def run(params: Params, inputs: Mapping[str, InputFile], workdir: Path) -> StageResult:
    """Judge ``package/model.gguf``; writes validation.json, raises ValidationFailed on any failed check."""
    from pipeline.formats.gguf.readback import inspect_gguf
    from pipeline.stages.validate.probe import run_probe

    item = inputs.get("package/model.gguf")
    if item is None:
        raise InputError(f"validate needs package/model.gguf; inputs were {sorted(inputs)}")
    workdir = Path(workdir)
    checks: list[Check] = []
    candidate: dict[str, Any] | None = None
    source: dict[str, Any] | None = None
    summary = None
    try:
        summary = inspect_gguf(item.path)
    except IntegrityError as exc:
        checks.append(Check("loads", "fail", f"the file's GGUF structure is broken: {exc}"))
    if summary is not None:
        candidate, why = run_probe(_request(item.path, params), workdir, params.timeout_s, label="converted")
        if candidate is None:
            checks.append(Check("loads", "fail", why))
        else:
            checks.append(
                Check(
                    "loads",
                    "pass",
                    f"loaded in {candidate['load_s']:.2f} s on {candidate['backend']['device']}",
                    {"load_s": candidate["load_s"]},
                )
            )
            more, source = _checks(candidate, item.path, summary, params, inputs, workdir)
            checks += more
    report = _report(params, item, summary, candidate, checks, source)
    path = _write_report(workdir, report)
    log.info("validate: verdict %s; text %r; checks %s", report["verdict"], report["text"], report["checks"])
    failed = [c for c in checks if c.verdict == "fail"]
    if failed:
        raise ValidationFailed(
            "validation failed: "
            + "; ".join(f"{c.name}: {c.reason}" for c in failed)
            + f" (report kept at {path})",
            report,
        )
    warnings = tuple(f"{c.name}: {c.reason}" for c in checks if c.verdict == "warn")
    return StageResult(
        outputs=(OutputFile(OUTPUT_NAME, path, "validation-report", "application/json"),),
        metrics=report,
        warnings=warnings,
    )
