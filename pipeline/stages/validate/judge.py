"""Judging what a model generated and how far its predictions are from its source's.

Pure functions over token ids, texts and logits (numpy): no llama.cpp; the agreement check reads the
candidate's logits file and scores it against calibrate's stored source reference.

Example::

    repetition_of([5, 5, 5, 5], "tre tre tre tre")        # 'token 5 repeats 4+ times in a row'
    stats = agreement_stats(source_logits, candidate_logits, tokens)
    stats.top1_agreement, stats.mean_kl
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.calibration.answers import AGREEMENT
from pipeline.calibration.predictions import AgreementStats, agreement_stats
from pipeline.core.errors import IntegrityError
from pipeline.core.verdicts import Verdict
from pipeline.ternary.policy import meets_quality

if TYPE_CHECKING:
    from pipeline.calibration.agreement import ReferenceAgreement
    from pipeline.calibration.probe import Generation, ProbeResult
    from pipeline.calibration.reference import SourceReference
    from pipeline.formats.decompose_report import DecomposeReport
    from pipeline.stages.validate.params import Params

__all__ = [
    "Check", "AgreementStats", "repetition_of", "first_answer", "agreement_stats", "verdict_of",
    "answer_check", "source_answer_check", "repetition_check", "agreement_check", "exact_agreement",
]

_MAX_TOKEN_RUN = 4  # the same token this many times in a row is a loop, not an answer
_MAX_LOOP_PERIOD = 8  # longest token cycle looked for
_LOOP_MATCH = 0.8  # a cycle may be imperfect: this share of the tail must follow it
_MIN_TEXT_UNIT_REPEATS = 3  # " tre tre tre": a unit of text three times in a row...
_MIN_TEXT_LOOP_CHARS = 6  # ...spanning at least this many characters ("111111", "ababab")
_MAX_TEXT_UNIT_CHARS = 16


@dataclass(frozen=True)
class Check:
    """One judged sign, its `Verdict`; ``numbers`` back the reason."""

    name: str
    verdict: Verdict
    reason: str
    numbers: dict[str, Any] | None = None


def verdict_of(checks: list[Check]) -> Verdict:
    """The worst verdict among the checks (pass when there are none)."""
    return Verdict.worst(c.verdict for c in checks)


def _token_loop(tokens: list[int]) -> str | None:
    run_token, run_len = None, 0
    for token in tokens:
        run_len = run_len + 1 if token == run_token else 1
        run_token = token
        if run_len >= _MAX_TOKEN_RUN:
            return f"token {token} repeats {run_len}+ times in a row"
    if len(tokens) < 6:
        return None
    top_token, top = Counter(tokens).most_common(1)[0]
    if top * 2 >= len(tokens):
        return f"token {top_token} makes up {top} of {len(tokens)} generated tokens"
    tail = tokens[len(tokens) // 3 :]
    for period in range(1, _MAX_LOOP_PERIOD + 1):
        if len(tail) < 2 * period + 1:
            break
        total = len(tail) - period
        same = sum(tail[i] == tail[i - period] for i in range(period, len(tail)))
        # An exact cycle needs two turns; an imperfect one (80%) needs three to count.
        if same == total or (len(tail) >= 3 * period and same >= _LOOP_MATCH * total):
            return f"the output cycles with a period of {period} token(s) ({same}/{total} match)"
    return None


def _text_loop(text: str) -> str | None:
    # A unit of 1..16 characters repeated back to back: "111111", " tre tre tre", "ababab".
    pattern = rf"(.{{1,{_MAX_TEXT_UNIT_CHARS}}}?)\1{{{_MIN_TEXT_UNIT_REPEATS - 1},}}"
    for match in re.finditer(pattern, text, flags=re.DOTALL):
        unit = match.group(1)
        if len(match.group(0)) >= _MIN_TEXT_LOOP_CHARS and unit.strip():
            count = len(match.group(0)) // len(unit)
            return f"{unit!r} repeats {count} times in a row in {text!r}"
    return None


def repetition_of(tokens: list[int], text: str) -> str | None:
    """A description of a degenerate loop in generated output, or None.

    Judged on token ids: a token 4+ times in a row; one token making up half the output; a
    tail that follows a cycle of up to 8 tokens (80% of it, so one odd token does not hide a
    loop). The decoded text is not judged: distinct byte tokens each render as U+FFFD, and
    "111111" may be three different tokens. Only when no ids are known (an old report) does
    the text stand in: a non-blank unit of up to 16 characters repeated 3+ times back to back.
    Counting ("2+1=3\n3+1=4") is not a loop: its units differ.
    """
    if tokens:
        return _token_loop(tokens)
    return _text_loop(text)


def first_answer(text: str) -> str | None:
    """The first number in a completion ("2" in " 2, 2+1=3"), or None when there is none."""
    match = re.search(r"-?\d+(?:\.\d+)?", text)
    return match.group(0) if match else None


def _agreement_tokens(reference: SourceReference) -> tuple[int, ...]:
    """The agreement text's token ids the reference was made on (none when it has no such sequence)."""
    names = reference.sequences.names
    return tuple(reference.sequences.ids[names.index(AGREEMENT)]) if AGREEMENT in names else ()


def _score(reference: SourceReference, candidate: ProbeResult, tokens: Sequence[int]) -> ReferenceAgreement:
    """The candidate's logits on the agreement text against the reference's (same token ids)."""
    from pipeline.calibration.agreement import ReferenceScorer

    scorer = ReferenceScorer(reference, [AGREEMENT])
    (index,) = scorer.indices
    if list(reference.sequences.ids[index]) != list(tokens):
        raise IntegrityError("the source reference was made on other tokens of the agreement text; "
                             "retry the job from calibrate")
    scorer.add(index, np.load(str(candidate.logits_path)))
    return scorer.result()


# --- checks over what llama.cpp did with each model (`probe` results) ---------------------------


def answer_check(
    name: str, out: Generation | None, expected: str, source_out: Generation | None
) -> Check:
    text = out.text if out else ""
    found = first_answer(text)
    source_found = first_answer(source_out.text) if source_out else None
    numbers = {
        "prompt": out.prompt if out else None,
        "text": text,
        "first_number": found,
        "expected": expected,
        "source_text": source_out.text if source_out else None,
        "source_first_number": source_found,
    }
    # The first number must be the answer: "12" or "3, 2" contain "2" but are wrong.
    if found == expected:
        return Check(name, Verdict.PASS, f"{numbers['prompt']!r} -> {text!r} answers {expected!r}", numbers)
    blame = (
        f"; the source answers {source_found!r}, so the conversion lost it"
        if source_found == expected
        else "; the source does not answer it either"
        if source_out
        else ""
    )
    return Check(
        name,
        Verdict.WARN,
        f"{numbers['prompt']!r} -> {text!r}: first number {found!r}, expected {expected!r}{blame}",
        numbers,
    )


def source_answer_check(source: ProbeResult | None, params: Params) -> Check | None:
    if source is None:
        return None
    out = source.completions[0]
    found = first_answer(out.text)
    numbers = {
        "prompt": out.prompt,
        "text": out.text,
        "first_number": found,
        "expected": params.expected,
    }
    if found == params.expected:
        return Check(
            "source_answer", Verdict.PASS,
            f"the source answers: {out.prompt!r} -> {out.text!r}", numbers
        )
    return Check(
        "source_answer",
        Verdict.WARN,
        f"the source itself does not answer {params.expected!r}: "
        f"{out.prompt!r} -> {out.text!r}; the answer checks say little about the conversion",
        numbers,
    )


def _outputs(probe: ProbeResult) -> dict[str, Generation]:
    found: dict[str, Generation] = {"completion": probe.completions[0]}
    if probe.chat:
        found["chat"] = probe.chat
    return found


def _same_output(out: Generation, source_out: Generation | None) -> bool:
    if source_out is None:
        return False
    return list(out.tokens) == list(source_out.tokens) or out.text == source_out.text


def repetition_check(candidate: ProbeResult, source: ProbeResult | None) -> Check:
    """Loops in what the converted model generated, judged against its source on the same prompt.

    Fail only when the source, given the same prompt, neither loops nor generates the same
    tokens: then the conversion made the loop. Otherwise warn (the model does it by itself).
    """
    outputs = _outputs(candidate)
    loops = {kind: repetition_of(list(out.tokens), out.text) for kind, out in outputs.items()}
    loops = {kind: why for kind, why in loops.items() if why}
    if not loops:
        return Check("repetition", Verdict.PASS, "no degenerate loop in the generated tokens", {"loops": {}})
    source_outputs = _outputs(source) if source is not None else {}
    source_loops = {
        kind: repetition_of(list(out.tokens), out.text) for kind, out in source_outputs.items()
    }
    same = sorted(kind for kind in loops if _same_output(outputs[kind], source_outputs.get(kind)))
    numbers = {"loops": loops, "source_loops": {k: v for k, v in source_loops.items() if v},
               "same_as_source": same}
    listed = "; ".join(f"{kind}: {why}" for kind, why in loops.items())
    if source is None:
        return Check("repetition", Verdict.WARN, f"{listed} (no source run to compare with)", numbers)
    introduced = [kind for kind in loops if not source_loops.get(kind) and kind not in same
                  and kind in source_outputs]
    if introduced:
        return Check(
            "repetition",
            Verdict.FAIL,
            f"{listed}; on the same prompt the source does not loop ({', '.join(introduced)}), so the "
            "conversion broke it",
            numbers,
        )
    why_not = {kind: "the source generates the very same tokens" if kind in same
               else "the source did not run it" if kind not in source_outputs
               else "the source loops too" for kind in loops}
    return Check("repetition", Verdict.WARN, f"{listed}; on the same prompt "
                 + "; ".join(f"{kind}: {reason}" for kind, reason in why_not.items())
                 + ", so the conversion is not to blame", numbers)


def exact_agreement() -> Check:
    """Agreement for a file decompose proved bit-exact: nothing to measure, the weights are the source's."""
    return Check("agreement", Verdict.PASS,
                 "not measured: weights bit-exact (decompose decoded every tensor it wrote back to the "
                 "source's values; its report.json is the proof), so the file computes what the source does",
                 {"measured": False, "exact": True})


def agreement_check(
    candidate: ProbeResult,
    source_why: str,
    params: Params,
    reference: SourceReference | None = None,
) -> Check:
    """Top-1 agreement and mean KL over the agreement text, judged against the thresholds.

    The source's side is calibrate's stored reference (top-k log-probs and tail draws): the KL is
    its unbiased estimate, ``mean_kl_lower`` a guaranteed lower bound, ``mean_kl_stderr`` the
    noise the draws leave (`calibration.agreement`).
    """
    if reference is None:
        return Check("agreement", Verdict.WARN, f"agreement with the source not measured: {source_why}")
    if not params.probe.agreement_text:
        return Check("agreement", Verdict.WARN, "agreement not measured: the agreement text option is empty")
    # The source's side is the reference alone: its vocabulary and the agreement tokens it scored.
    if candidate.n_vocab != reference.n_vocab:
        return Check(
            "agreement",
            Verdict.FAIL,
            f"vocabularies differ: source {reference.n_vocab} tokens, converted {candidate.n_vocab}",
            {"n_vocab": [reference.n_vocab, candidate.n_vocab]},
        )
    ids_src = _agreement_tokens(reference)
    ids_cand = candidate.text.tokens if candidate.text else ()
    if ids_src != ids_cand:
        first = next(
            (i for i, (a, b) in enumerate(zip(ids_src, ids_cand, strict=False)) if a != b),
            min(len(ids_src), len(ids_cand)),
        )
        return Check(
            "agreement",
            Verdict.FAIL,
            f"the tokenizers disagree on the agreement text: source "
            f"{len(ids_src)} tokens, converted {len(ids_cand)}, first difference at token {first}",
        )
    scored = _score(reference, candidate, ids_src)
    stats = scored.stats
    numbers: dict[str, Any] = {
        k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(stats).items()
    }
    numbers.update({
        "mean_kl_lower": round(scored.mean_kl_lower, 6), "mean_kl_stderr": round(scored.mean_kl_stderr, 6),
        "reference_top_k": scored.top_k, "reference_tail_samples": scored.tail_samples,
    })
    numbers["is_text_truncated"] = bool(candidate.text and candidate.text.is_truncated)  # same tokens
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
            Verdict.FAIL,
            f"{detail}: no closer to the source than a model that knows "
            "nothing; the converted model no longer predicts like its source",
            numbers,
        )
    if stats.top1_agreement < params.agreement_fail_top1 or stats.mean_kl > params.agreement_fail_kl:
        return Check(
            "agreement",
            Verdict.FAIL,
            f"{detail}: below the floor (top-1 >= "
            f"{params.agreement_fail_top1:.0%} and KL <= {params.agreement_fail_kl:g}); the converted "
            "model no longer predicts like its source",
            numbers,
        )
    if stats.top1_agreement < params.agreement_pass_top1 or stats.mean_kl > params.agreement_pass_kl:
        return Check(
            "agreement",
            Verdict.WARN,
            f"{detail}: short of a pass (top-1 >= {params.agreement_pass_top1:.0%} "
            f"and KL <= {params.agreement_pass_kl:g})",
            numbers,
        )
    return Check("agreement", Verdict.PASS, detail, numbers)


def quality_target_check(agreement: Check, report: DecomposeReport | None) -> Check | None:
    """The auto recipe's ``min_top1`` / ``max_kl``, confirmed on the agreement text (which its search,
    scoring on the calibration text, never saw); None when the job set no quality target."""
    allocation = report.header.allocation if report else None
    searched = allocation.search if allocation else None
    if searched is None:
        return None
    min_top1, max_kl = searched.min_top1, searched.max_kl
    wanted = " and ".join(([f"top-1 >= {min_top1:.0%}"] if min_top1 is not None else [])
                          + ([f"KL <= {max_kl:g}"] if max_kl is not None else []))
    numbers = agreement.numbers or {}
    top1, kl = numbers.get("top1_agreement"), numbers.get("mean_kl")
    if top1 is None or kl is None:
        return Check("quality_target", Verdict.FAIL,
                     f"the job asks for {wanted}, but agreement with the source "
                     f"was not measured: {agreement.reason}")
    chosen = searched.best
    met = meets_quality(min_top1, max_kl, top1, kl)
    detail = (f"asked {wanted}: top-1 {top1:.1%}, mean KL {kl:.3f} on the agreement text (the search "
              f"measured {chosen.top1:.1%} and {chosen.mean_kl:.3f} on the calibration text, "
              f"{len(searched.trials)} files tried)")
    figures = {"min_top1": min_top1, "max_kl": max_kl, "top1_agreement": top1, "mean_kl": kl,
               "search_top1": chosen.top1, "search_kl": chosen.mean_kl}
    if met:
        return Check("quality_target", Verdict.PASS, detail, figures)
    return Check("quality_target", Verdict.FAIL,
                 f"{detail}; not met: loosen the target, raise target_bpw, or give "
                 "a calibration text (--calibration FILE) closer to what the model will read", figures)
