"""Checks on the converted file itself: skeleton sparsity, bits per weight, tensor types.

Each compares what the file holds with what decompose decided (its ``report.json``) and
with the recipe, and returns a `judge.Check` with the numbers behind its verdict.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.verdicts import Verdict
from pipeline.formats.decompose_report import DecomposeReport
from pipeline.formats.gguf.readback import GGUFSummary
from pipeline.formats.gguf.reader import GGUFFile
from pipeline.formats.gguf.types import GGMLTypeName, block_geometry
from pipeline.stages.validate.judge import Check

__all__ = [
    "check_sparsity",
    "check_bits_per_weight",
    "check_types",
    "recipe_ternary_type",
    "sampled_sparsity",
]

_LINEAR = re.compile(
    r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|attn_qkv|ffn_gate|ffn_up|ffn_down)\.weight$"
)
_TERNARY_TYPES = (GGMLTypeName.TQ1_0, GGMLTypeName.TQ2_0, GGMLTypeName.Q2_0)  # sparsity applies to these
_LOW_BIT_TYPES = (*_TERNARY_TYPES, GGMLTypeName.Q1_0)  # fitted types, Q1_0's binary one included
_BPW_PASS_REL = 0.01  # linear weights within 1% of the expected rate
_BPW_WARN_REL = 0.25  # within 25%: close; beyond: the recipe was not applied
_SPARSITY_SAMPLE_ROWS = 64  # rows per tensor decoded to measure sparsity from the file itself
_SPARSITY_DISAGREE = 0.05
_MAX_FALLBACKS_LISTED = 200


def sampled_sparsity(path: Path) -> tuple[float | None, int]:
    """Fraction of zero weights in the file's ternary tensors (sampled rows), and their count."""
    from pipeline.ternary.pack import decode_bytes  # torch: only where sparsity is measured

    zeros = total = n_tensors = 0
    for tensor in GGUFFile(path).tensors:
        if tensor.tensor_type.name not in _TERNARY_TYPES:
            continue
        n_tensors += 1
        data = np.asarray(tensor.data)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        pick = np.linspace(0, rows.shape[0] - 1, min(rows.shape[0], _SPARSITY_SAMPLE_ROWS)).astype(np.int64)
        values = decode_bytes(np.ascontiguousarray(rows[pick]), tensor.tensor_type.name, (-1,))
        zeros += int(np.count_nonzero(values == 0))
        total += int(values.size)
    return (zeros / total if total else None), n_tensors


def check_sparsity(path: Path, report: DecomposeReport | None) -> Check:
    """Fail at 0% zeros (every weight ±1: the fit collapsed); warn when file and report disagree."""
    measured, n_tensors = sampled_sparsity(path)
    reported = report.totals.sparsity if report else None
    numbers = {"measured": measured, "reported": reported, "n_ternary_tensors": n_tensors}
    if n_tensors == 0 or measured is None:
        return Check(
            "sparsity",
            Verdict.WARN,
            "the file has no ternary (TQ1_0/TQ2_0) tensors; sparsity not applicable",
            numbers,
        )
    detail = f"measured {measured:.1%} zeros over sampled rows of {n_tensors} ternary tensors"
    if reported is not None:
        detail += f"; decompose reported {reported:.1%}"
    if measured == 0.0 or reported == 0.0:
        return Check(
            "sparsity",
            Verdict.FAIL,
            f"0% sparsity: every ternary weight is ±1, the fit collapsed ({detail})",
            numbers,
        )
    if reported is not None and abs(measured - reported) > _SPARSITY_DISAGREE:
        return Check(
            "sparsity", Verdict.WARN, f"file and report disagree by more than 5 points ({detail})", numbers
        )
    return Check("sparsity", Verdict.PASS, detail, numbers)


def recipe_ternary_type(recipe: str, report: DecomposeReport | None) -> str | None:
    """The ternary type the recipe asked for: from decompose's report, else the named recipe."""
    from pipeline.ternary.policy import RECIPES

    if report and report.header.ternary_type is not None:
        return report.header.ternary_type
    known = RECIPES.get(recipe)
    return known.ternary_type if known else None


def _type_bpw(type_name: str) -> float:
    block, size = block_geometry(type_name)
    return size * 8 / block


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _linear_bpw(shapes: Mapping[str, tuple[int, ...]], types: Mapping[str, str]) -> tuple[float, int, int]:
    """(bits per weight, params, ternary params) over the block linear weights of `types`."""
    linear = [n for n in types if _LINEAR.match(n) and n in shapes]
    n_params = sum(_numel(shapes[n]) for n in linear)
    n_bits = sum(_numel(shapes[n]) * _type_bpw(types[n]) for n in linear)
    n_ternary = sum(_numel(shapes[n]) for n in linear if types[n] in _LOW_BIT_TYPES)
    return (n_bits / n_params if n_params else 0.0), n_params, n_ternary


def _planned(report: DecomposeReport | None) -> dict[str, str]:
    """Each tensor's type as decompose decided it."""
    return {t.name: t.ggml_type for t in report.tensors} if report else {}


def check_bits_per_weight(
    summary: GGUFSummary, ternary_type: str | None, report: DecomposeReport | None
) -> Check:
    """Block linear weights at the rate decompose decided, and how far that is from the recipe's.

    With a report: the file's rate must equal the rate of decompose's decisions (fail
    otherwise: the file is not what was decided); named fallbacks below the recipe's rate
    make it a warning. Without one: compared with the recipe's ternary rate directly.
    """
    if ternary_type is None:
        return Check("bits_per_weight", Verdict.WARN,
                     "unknown recipe: no bits-per-weight target to compare with")
    target = _type_bpw(ternary_type)
    bpw, n_params, n_ternary = _linear_bpw(summary.shapes, summary.tensor_types)
    if not n_params:
        return Check("bits_per_weight", Verdict.FAIL, "the file has no block linear weights to measure")
    fallbacks = [asdict(f) for f in report.fallbacks[:_MAX_FALLBACKS_LISTED]] if report else []
    numbers: dict[str, Any] = {
        "linear_bpw": round(bpw, 4),
        "recipe_bpw": target,
        "file_bpw": round(summary.bits_per_weight, 4),
        "linear_params": n_params,
        "ternary_share": round(n_ternary / n_params, 4),
        "n_fallbacks": len(report.fallbacks) if report else 0,
        "fallbacks": fallbacks,
    }
    detail = (
        f"block linear weights at {bpw:.4f} bpw ({n_ternary / n_params:.1%} of them {ternary_type}), "
        f"recipe {ternary_type} is {target:.4f}; whole file {summary.bits_per_weight:.3f}"
    )
    planned = _planned(report)
    if planned:
        expected, _, _ = _linear_bpw(summary.shapes, planned)
        numbers["decided_bpw"] = round(expected, 4)
        if abs(bpw - expected) > _BPW_PASS_REL * expected:
            return Check("bits_per_weight", Verdict.FAIL,
                         f"{detail}; decompose decided {expected:.4f}", numbers)
        allocation = report.header.allocation if report else None
        if allocation is not None:
            # The auto recipe has no single rate: its budget is over all 2-D weights, checked here.
            spent, target_bpw = allocation.spent_bpw, allocation.target_bpw
            numbers.update(recipe_bpw=target_bpw, allocation_bpw=spent)
            verdict = Verdict.PASS if allocation.reachable else Verdict.WARN
            return Check("bits_per_weight", verdict, f"{detail.split(', recipe ')[0]}; "
                         "the auto allocation spends "
                         f"{spent} bpw of its target {target_bpw} over the 2-D weights; whole file "
                         f"{summary.bits_per_weight:.3f}", numbers)
        if abs(bpw - target) <= _BPW_PASS_REL * target:
            return Check("bits_per_weight", Verdict.PASS, detail, numbers)
        reasons = Counter(_reason_kind(f["reason"]) for f in fallbacks)
        why = "; ".join(f"{n}× {kind}" for kind, n in reasons.most_common(3))
        return Check(
            "bits_per_weight", Verdict.WARN,
            f"{detail}: {numbers['n_fallbacks']} named fallbacks ({why})", numbers
        )
    rel = abs(bpw - target) / target
    verdict = Verdict.PASS if rel <= _BPW_PASS_REL else Verdict.WARN if rel <= _BPW_WARN_REL else Verdict.FAIL
    return Check("bits_per_weight", verdict, detail, numbers)


def _reason_kind(reason: str) -> str:
    """A fallback reason without its tensor name: 'row length 640 is not a multiple of 256 ...'."""
    return reason.split(": ", 1)[-1]


def check_types(summary: GGUFSummary, ternary_type: str | None, report: DecomposeReport | None) -> Check:
    """Every tensor has the type decompose decided (or, without a report, linears are ternary)."""
    from pipeline.formats.hf.architectures import GENERATED_TENSORS

    planned = _planned(report)
    types = dict(summary.types)
    if planned:
        wrong = [
            f"{n}: {summary.tensor_types.get(n)} (planned {t})"
            for n, t in planned.items()
            if summary.tensor_types.get(n) != t
        ]
        # Package computes some tensors from config.json; decompose never plans them.
        extra = sorted(set(summary.tensor_types) - set(planned) - set(GENERATED_TENSORS))
        numbers = {"types": types, "n_wrong": len(wrong), "unplanned": extra[:5]}
        if wrong or extra:
            return Check(
                "tensor_types",
                Verdict.FAIL,
                f"types differ from decompose's plan: {wrong[:5]}, unplanned {extra[:5]}",
                numbers,
            )
        return Check(
            "tensor_types", Verdict.PASS,
            f"all {len(planned)} tensors have the types decompose decided", numbers
        )
    if ternary_type is None:
        return Check(
            "tensor_types",
            Verdict.WARN,
            "no decompose report and unknown recipe: types not checked",
            {"types": types},
        )
    off = [n for n, t in summary.tensor_types.items() if _LINEAR.match(n) and t != ternary_type]
    if off:
        return Check(
            "tensor_types",
            Verdict.WARN,
            f"{len(off)} linear weights are not {ternary_type} and no report names why: {off[:5]}",
            {"types": types, "n_off": len(off)},
        )
    return Check("tensor_types", Verdict.PASS,
                 f"every block linear weight is {ternary_type}", {"types": types})
