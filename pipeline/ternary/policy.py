"""Which GGUF tensors become ternary, and what every other tensor is stored as.

A policy is a function of a tensor's GGUF name, its torch shape ``[rows, cols]`` and the
recipe: `decide`. Every decision carries a reason naming the tensor; a tensor that the
recipe would have liked ternary but cannot be (rows not a multiple of the type's block:
256 for TQ2_0/TQ1_0, 64 for Q2_0, 128 for Q1_0; an unknown 2-D tensor) is a *fallback* and
the report lists it. Nothing falls back silently. ``is_ternary`` marks every fitted low-bit
tensor, Q1_0's binary ones included.

Example::

    recipe = get_recipe("tq2_0", {"method": "optimal"})
    decide("blk.0.ffn_down.weight", (256, 640), recipe)
    # TensorDecision(ggml_type='F16', is_ternary=False, is_fallback=True,
    #   reason='blk.0.ffn_down.weight: row length 640 is not a multiple of 256 (TQ2_0 block size);
    #           kept as F16')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.option_fields import option
from pipeline.formats.gguf.types import GGMLTypeName, block_geometry
from pipeline.ternary.backends import TARGETS, Support, support
from pipeline.ternary.codecs import CODECS, codec_for

__all__ = [
    "Recipe", "TensorDecision", "RECIPES", "LINEAR_KINDS", "METHODS", "HIGH_PRECISION",
    "FALLBACK_TYPES", "SOURCE_16", "AUTO", "get_recipe", "decide", "stored_type", "importance_for",
    "reads_statistics",
]

# Per-block linear weights llama.cpp multiplies activations by: the ternary candidates.
LINEAR_KINDS: tuple[str, ...] = (
    "attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "ffn_gate", "ffn_up", "ffn_down",
)
_LINEAR = re.compile(r"^blk\.(\d+)\.(" + "|".join(LINEAR_KINDS) + r")\.weight$")
GPTQ = "gptq"  # the error-compensating fit: needs the calibrate stage's Gram matrices
# Every codec's per-block fits, then gptq (each type's own fits: `codecs`, e.g. Q1_0 has no absmax).
METHODS = (*dict.fromkeys(method for codec in CODECS.values() for method in codec.methods), GPTQ)
# The default of every plain 2-D tensor's type: the source's own 16-bit type (BF16 stays BF16, as
# llama.cpp's converter keeps it with --outtype auto; anything else F16), so a ternary-trained BF16
# checkpoint converts bit for bit. On a target whose backend lacks BF16 (`backends`) it means F16.
SOURCE_16 = "source"
HIGH_PRECISION = (SOURCE_16, GGMLTypeName.F16, GGMLTypeName.BF16, GGMLTypeName.F32, GGMLTypeName.Q8_0)
FALLBACK_TYPES = (SOURCE_16, GGMLTypeName.F16, GGMLTypeName.BF16, GGMLTypeName.F32)
_TYPE_KNOBS = ("embed_type", "output_type", "fallback_type")
_TARGET_BPW_RANGE = (1.5, 8.5)  # all ternary Q2_0 .. all Q8_0
# The auto recipe's rung costs: the allocator's proxy, or the KL each group's step adds (`sensitivity`).
PROXY, MEASURED = "proxy", "measured"
SENSITIVITIES = (PROXY, MEASURED)
_Q8_0_BLOCK = 32


@dataclass(frozen=True)
class Recipe:
    """A named set of policy knobs.

    ``ternary_type``: TQ2_0 (2.0625 bpw), TQ1_0 (1.6875 bpw), Q2_0 (2.25 bpw, groups of 64) or
    Q1_0 (binary, 1.125 bpw, groups of 128). ``method``: the per-block fit, or ``gptq``: the
    error-compensating fit against each layer's input Gram matrix (from the calibrate stage). ``irls_iters``:
    refinement passes after the fit (0 = none; TQ recipes only, the Q fits are exact).
    ``levels``: Q2_0 only: 3 = ternary codes (ternary Bonsai), 4 = also code +2 with a signed
    scale (the grid {-1,0,1,2}·d or its mirror). ``embed_type`` / ``output_type``:
    storage of ``token_embd.weight`` / ``output.weight``. ``fallback_type``: what an ineligible
    2-D tensor is kept as.
    """

    name: str
    ternary_type: str
    method: str = option("optimal", help="per-block fit (q1_0: optimal or absmean)", choices=METHODS)
    irls_iters: int = option(0, help="refinement passes after the fit (tq recipes only)", low=0, high=100)
    levels: int = option(3, help="q2_0 only: 3 = ternary codes, 4 = also code +2", low=3, high=4)
    embed_type: str = option(SOURCE_16, help="type of token_embd.weight; source: the source's own 16-bit "
                             "type (BF16 stays BF16, else F16; F16 for a target without BF16: metal), so a "
                             "ternary-trained BF16 checkpoint converts bit for bit and its source never runs",
                             choices=HIGH_PRECISION)
    output_type: str = option(SOURCE_16, help="type of output.weight (source: as embed_type)",
                              choices=HIGH_PRECISION)
    fallback_type: str = option(SOURCE_16, help="type of a 2-D tensor that cannot be ternary (source: as "
                                "embed_type)", choices=FALLBACK_TYPES)
    target_bpw: float = option(0.0, shown_default=None, low=_TARGET_BPW_RANGE[0], high=_TARGET_BPW_RANGE[1],
                               help="auto only: bits per weight the 2-D weights may take (default 4.0; with "
                               "min_top1 / max_kl: the most they may take); the types that lose least within "
                               "it are chosen")
    min_top1: float = option(0.0, shown_default=None, low=0, high=1,
                             help="auto only: the smallest file whose top-1 agreement with the source "
                             "(on the calibration text; validate confirms on its own) is at least this")
    max_kl: float = option(0.0, shown_default=None, low=0,
                           help="auto only: the smallest file whose mean KL from the source (nats) is "
                           "at most this; validate confirms")
    sensitivity: str = option(PROXY, shown_default=None, choices=SENSITIVITIES,
                              help="auto only: what a rung costs: measured (the default: the KL each group "
                              "step adds in llama.cpp, measured once per source; about 75 files for Gemma 3 "
                              "270M) or proxy (importance-weighted error: no files, ranks worse; the default "
                              "with importance=none)")

    @property
    def has_quality_target(self) -> bool:
        """Whether the smallest file meeting ``min_top1`` / ``max_kl`` is sought (decompose search)."""
        return self.min_top1 > 0.0 or self.max_kl > 0.0

    @property
    def reads_reference(self) -> bool:
        """Whether decompose scores files against calibrate's reference of the source: a quality
        target's search, or measured sensitivity."""
        return self.has_quality_target or self.sensitivity == MEASURED


@dataclass(frozen=True)
class TensorDecision:
    """How one tensor is stored and why; ``is_fallback`` marks a tensor denied ternary it was meant for.

    ``levels``: this tensor's Q2_0 levels when it differs from the recipe's (the ``auto`` recipe).
    """

    ggml_type: str
    is_ternary: bool
    reason: str
    is_fallback: bool = False
    levels: int | None = None


RECIPES: dict[str, Recipe] = {
    "tq2_0": Recipe(name="tq2_0", ternary_type=GGMLTypeName.TQ2_0),
    "tq1_0": Recipe(name="tq1_0", ternary_type=GGMLTypeName.TQ1_0),
    "q2_0": Recipe(name="q2_0", ternary_type=GGMLTypeName.Q2_0),
    "q1_0": Recipe(name="q1_0", ternary_type=GGMLTypeName.Q1_0),
    # Mixed precision by measured sensitivity (`ternary.sensitivity`): each 2-D weight gets the type
    # whose KL is worth its bytes, within target_bpw over all of them.
    "auto": Recipe(name="auto", ternary_type=GGMLTypeName.Q2_0, embed_type=GGMLTypeName.Q8_0,
                   output_type=GGMLTypeName.Q8_0, target_bpw=4.0, sensitivity=MEASURED),
}
AUTO = "auto"
_LEVELS_RECIPES = ("q2_0",)

_ALLOWED: dict[str, tuple[Any, ...]] = {
    "method": METHODS,
    "sensitivity": SENSITIVITIES,
    "embed_type": HIGH_PRECISION,
    "output_type": HIGH_PRECISION,
    "fallback_type": FALLBACK_TYPES,
}


def get_recipe(name: str, options: Mapping[str, Any] | None = None) -> Recipe:
    """The named recipe with any of its knobs overridden by ``options`` (other keys are ignored).

    Raises InputError for an unknown recipe name (listing the known ones) or a knob value
    out of range (listing the allowed values).
    """
    if name not in RECIPES:
        raise InputError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}")
    recipe = RECIPES[name]
    knobs = {f.name for f in fields(Recipe)} - {"name", "ternary_type"}
    changes: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key not in knobs:
            continue  # options are shared by all stages; other stages own other keys
        if key == "irls_iters":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 100:
                raise InputError(f"recipe option irls_iters={value!r}; expected an integer from 0 to 100")
            if value and not codec_for(recipe.ternary_type).irls:
                raise InputError(f"recipe option irls_iters={value!r} does not apply to recipe {name!r}: "
                                 "its optimal fit is already exact; leave irls_iters at 0")
        elif key == "levels":
            if name not in _LEVELS_RECIPES:
                raise InputError(f"recipe option levels={value!r} applies to recipe q2_0 only, not {name!r}; "
                                 "remove it")
            if value not in (3, 4) or isinstance(value, bool):
                raise InputError(f"recipe option levels={value!r}; expected 3 (ternary) or 4 (adds code +2)")
        elif key == "target_bpw":
            low, high = _TARGET_BPW_RANGE
            if name != AUTO:
                raise InputError(f"recipe option target_bpw={value!r} applies to recipe auto only, "
                                 f"not {name!r}; remove it or use --recipe auto")
            if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
                raise InputError(f"recipe option target_bpw={value!r}; expected a number from {low} to "
                                 f"{high} "
                                 "(bits per weight over the 2-D weights)")
            value = float(value)
        elif key in ("min_top1", "max_kl"):
            value = _quality_target(name, key, value)
        elif key == "sensitivity" and value == MEASURED and name != AUTO:
            raise InputError(f"recipe option sensitivity={value!r} applies to recipe auto only, not "
                             f"{name!r}; remove it or use --recipe auto")
        elif key == "method" and name == AUTO and value != "optimal":
            raise InputError(f"recipe option method={value!r} for recipe auto; its rungs are fitted with the "
                             "exact optimum (method=optimal): remove the option")
        elif key == "method":
            allowed = (*codec_for(recipe.ternary_type).methods, GPTQ)
            if value not in allowed:
                raise InputError(f"recipe option method={value!r} for recipe {name!r}; expected one of "
                                 f"{', '.join(allowed)}")
        elif value not in _ALLOWED[key]:
            raise InputError(f"recipe option {key}={value!r}; expected one of {', '.join(_ALLOWED[key])}")
        changes[key] = value
    if name == AUTO and "sensitivity" not in changes and (options or {}).get("importance") == "none":
        # Files are scored on the calibration text, which calibrate covers only with an imatrix.
        changes["sensitivity"] = PROXY
    if name == AUTO and ("min_top1" in changes or "max_kl" in changes) and "target_bpw" not in changes:
        changes["target_bpw"] = _TARGET_BPW_RANGE[1]  # a quality target: any size it takes, up to all Q8_0
    result = replace(recipe, **{**changes, **_without_bf16(recipe, changes, (options or {}).get("target"))})
    if result.method == GPTQ and result.irls_iters:
        raise InputError(f"recipe option irls_iters={result.irls_iters} does not combine with method=gptq, "
                         "which fits against the layer's inputs instead; leave irls_iters at 0")
    return result


def _without_bf16(recipe: Recipe, changes: Mapping[str, Any], target: Any) -> dict[str, str]:
    """``source`` types as F16 where the job's target runs BF16 only in part: the recipe is then the
    one an explicit F16 gives, cache key included."""
    if target not in TARGETS or support(GGMLTypeName.BF16, str(target)) is Support.FAST:
        return {}
    return {knob: GGMLTypeName.F16 for knob in _TYPE_KNOBS
            if changes.get(knob, getattr(recipe, knob)) == SOURCE_16}


def stored_type(ggml_type: str, source_dtype: str) -> str:
    """The type a plain tensor is written as: ``source`` resolved against the tensor's source dtype."""
    if ggml_type != SOURCE_16:
        return ggml_type
    return GGMLTypeName.BF16 if source_dtype.upper() == GGMLTypeName.BF16 else GGMLTypeName.F16


def meets_quality(min_top1: float | None, max_kl: float | None, top1: float, mean_kl: float,
                  top1_margin: float = 0.0) -> bool:
    """Whether agreement figures meet a quality target (a target of None or 0 is not set); top-1 must
    clear ``min_top1`` by ``top1_margin``."""
    return (not min_top1 or top1 >= min_top1 + top1_margin) and (not max_kl or mean_kl <= max_kl)


def _quality_target(recipe: str, key: str, value: Any) -> float:
    """``min_top1`` (0 < x <= 1) or ``max_kl`` (nats, > 0), for the auto recipe only."""
    if recipe != AUTO:
        raise InputError(f"recipe option {key}={value!r} applies to recipe auto only, not {recipe!r}; "
                         "remove it or use --recipe auto")
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if key == "min_top1" and not (is_number and 0.0 < value <= 1.0):
        raise InputError(f"recipe option min_top1={value!r}; expected a fraction above 0 and at most 1 "
                         "(top-1 agreement with the source, e.g. 0.6)")
    if key == "max_kl" and not (is_number and value > 0.0):
        raise InputError(f"recipe option max_kl={value!r}; expected a number of nats above 0 (e.g. 0.5)")
    return float(value)


def _plain(name: str, shape: tuple[int, ...], ggml_type: str, why: str, fallback: str) -> TensorDecision:
    """``ggml_type`` for a non-ternary tensor, unless Q8_0 does not fit its rows."""
    cols = shape[-1] if shape else 1
    if ggml_type == GGMLTypeName.Q8_0 and cols % _Q8_0_BLOCK:
        return TensorDecision(
            fallback, False,
            f"{name}: {why}; row length {cols} is not a multiple of 32 (Q8_0 block size); "
            f"kept as {fallback}",
            is_fallback=True,
        )
    return TensorDecision(ggml_type, False, f"{name}: {why}; stored as {ggml_type}")


def decide(gguf_name: str, shape: tuple[int, ...], recipe: Recipe, source_dtype: str = "") -> TensorDecision:
    """The storage type of tensor ``gguf_name`` with torch ``shape`` (``[rows, cols]``) under ``recipe``;
    ``source_dtype`` (the checkpoint's, e.g. BF16) resolves the ``source`` types (`stored_type`)."""
    shape = tuple(shape)
    tq = recipe.ternary_type
    fallback = stored_type(recipe.fallback_type, source_dtype)
    if len(shape) <= 1:
        return TensorDecision(GGMLTypeName.F32, False, f"{gguf_name}: 1-D tensor (norm or bias) kept as F32")
    if gguf_name == "token_embd.weight":
        return _plain(gguf_name, shape, stored_type(recipe.embed_type, source_dtype),
                      "token embedding kept in higher precision", fallback)
    if gguf_name == "output.weight":
        return _plain(gguf_name, shape, stored_type(recipe.output_type, source_dtype),
                      "output head kept in higher precision", fallback)
    if not _LINEAR.match(gguf_name):
        return TensorDecision(
            fallback, False,
            f"{gguf_name}: not a block linear weight ({', '.join(LINEAR_KINDS)}), shape {list(shape)}; "
            f"kept as {fallback}",
            is_fallback=True,
        )
    if len(shape) != 2:
        return TensorDecision(
            fallback, False, f"{gguf_name}: {len(shape)}-D weight {list(shape)} is not a 2-D matrix; "
            f"kept as {fallback}", is_fallback=True,
        )
    rows, cols = shape
    block_size, _ = block_geometry(tq)
    if cols % block_size or cols == 0:
        return TensorDecision(
            fallback, False,
            f"{gguf_name}: row length {cols} is not a multiple of {block_size} ({tq} block size); "
            f"kept as {fallback}",
            is_fallback=True,
        )
    fit = f"{recipe.method} fit, {recipe.levels} levels" if _has_levels(recipe) else f"{recipe.method} fit"
    return TensorDecision(tq, True, f"{gguf_name}: linear weight [{rows}, {cols}] -> {tq} ({fit})")


def _has_levels(recipe: Recipe) -> bool:
    """True when the recipe's ``levels`` knob applies (the q2_0 recipe)."""
    return recipe.name in _LEVELS_RECIPES


def reads_statistics(recipe: str, options: Mapping[str, Any]) -> bool:
    """Whether decompose under this recipe reads calibrate's outputs: an importance matrix, Gram
    matrices (gptq), or the source reference (a quality target). Known when the job is planned; it
    decides whether calibrate must come before decompose."""
    made = get_recipe(recipe, options)
    return importance_for(made.name, options) == "imatrix" or made.method == GPTQ or made.reads_reference


def importance_for(recipe: str, options: Mapping[str, Any]) -> str:
    """The ``importance`` a job uses: as given, else ``imatrix`` for auto (its costs are weighted), else
    none."""
    given = options.get("importance")
    if given:
        return str(given)
    return "imatrix" if recipe == AUTO else "none"
