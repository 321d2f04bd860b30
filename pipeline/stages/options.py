"""Every job option in one table, and the one check every job input goes through before a row exists.

A job is a source, a recipe and options (`--option KEY=VALUE` on the CLI, `options:` in a
manifest, `options` in the API's POST /api/jobs). `check_job_input` turns what a user typed
into what is recorded: the recipe by any of its spellings (``TQ2_0``, ``tq2_0``, ``tq2-0``,
llama.cpp's ``MOSTLY_TQ2_0``), type names in any case (``embed_type=f16`` -> ``F16``), values
of the declared kind (the CLI's text ``"3"`` -> ``3``), and refuses an unknown key with the
closest known ones. With no recipe, the ``target`` option picks the fast one for that backend.

Each option is declared once, on the stage's `Params` field (or `Recipe`'s, `ProbeSpec`'s) that holds
it: `core.option_fields.option(default, help=..., low=..., choices=...)`. `OPTIONS` is made from those
declarations; the stage reads its own fields (`core.option_fields.read_fields`), and `bonsai recipes`
and `bonsai convert --help` list them. Adding an option is adding that field.

Example::

    check_job_input("TQ2_0", {"embed_type": "q8_0", "n_ctx": "512"})
    # JobInput(recipe='tq2_0', options={'embed_type': 'Q8_0', 'n_ctx': 512}, warnings=())
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core import option_fields
from pipeline.core.errors import InputError
from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.backends import TARGETS, backend_warnings, default_recipe
from pipeline.ternary.policy import RECIPES, Recipe, get_recipe, stored_type

__all__ = ["Option", "OPTIONS", "JobInput", "DEFAULT_RECIPE", "canonical_recipe", "check_job_input",
           "job_warnings", "recipe_types", "KINDS"]

DEFAULT_RECIPE = "tq2_0"
KINDS = ("str", "int", "float", "bool", "list")


@dataclass(frozen=True)
class Option:
    """One job option. ``stage``: who reads it ("job" for the job as a whole). ``kind``: one of
    str, int, float, bool, list (of text). ``choices``: the allowed values, matched in any case
    and recorded as spelled here. ``low``/``high``: bounds of a number. ``default``: None when
    it is worked out (named in ``help``). ``check``: says why a text value is refused, or None."""

    key: str
    stage: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    check: Callable[[str], str | None] | None = None


@dataclass(frozen=True)
class JobOptions:
    """The options of the job as a whole."""

    target: str | None = option_fields.option(
        None, choices=TARGETS, help="where the GGUF will run; picks the recipe when none is given (cpu: "
        "tq2_0; cuda, metal, vulkan: q2_0) and warns about types that run slowly there")
    keep_source: bool = option_fields.option(
        True, help="keep the source's copy in the store once the job succeeds; false removes it then, "
        "unless another unfinished job or a pin holds it (`bonsai gc` takes the rest later)")


def _declared_options() -> dict[str, Option]:
    """Every option, from the fields that hold it (`core.option_fields.option`), stage by stage."""
    from pipeline.calibration.probe import ProbeSpec
    from pipeline.stages.calibrate.params import Params as CalibrateParams
    from pipeline.stages.decompose.stage import Params as DecomposeParams
    from pipeline.stages.package.stage import Params as PackageParams
    from pipeline.stages.validate.params import Params as ValidateParams

    holders: tuple[tuple[str, type], ...] = (
        ("job", JobOptions), ("decompose", Recipe), ("decompose", DecomposeParams),
        ("package", PackageParams), ("validate", ProbeSpec), ("validate", ValidateParams),
        ("calibrate", CalibrateParams),
    )
    table: dict[str, Option] = {}
    for stage, holder in holders:
        for found in option_fields.declared(holder):
            if found.key in table:
                raise TypeError(f"job option {found.key!r} is declared twice "
                                f"({table[found.key].stage}, {stage})")
            doc = found.doc
            table[found.key] = Option(found.key, stage, found.kind, found.default, doc.help, doc.choices,
                                      doc.low, doc.high, doc.check)
    return table


OPTIONS: dict[str, Option] = _declared_options()


@dataclass(frozen=True)
class JobInput:
    """A job's recipe and options as recorded, and the warnings they earn (a slow type on the target)."""

    recipe: str
    options: dict[str, Any]
    warnings: tuple[str, ...] = ()


def canonical_recipe(name: str) -> str:
    """The recipe `name` means, in any case and in llama.cpp's spellings; InputError naming the near ones."""
    spelled = name.strip().lower().replace("-", "_")
    for prefix in ("llama_ftype_", "mostly_"):
        spelled = spelled.removeprefix(prefix)
    if spelled in RECIPES:
        return spelled
    known = sorted(RECIPES)
    close = difflib.get_close_matches(spelled, known, n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise InputError(f"unknown recipe {name!r}; {hint}known recipes: {', '.join(known)} "
                     "(any case; `bonsai recipes` lists them)")


def recipe_types(recipe: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """Every tensor type a file of `recipe` (with its type options) holds, besides F32 norms."""
    made = get_recipe(recipe, options)
    # A `source` type still in the recipe may be BF16: the target runs BF16 wherever it stays.
    return sorted({stored_type(t, GGMLTypeName.BF16)
                   for t in (made.ternary_type, made.embed_type, made.output_type, made.fallback_type)})


def job_warnings(recipe: str, options: Mapping[str, Any]) -> list[str]:
    """What the job's `target` runs badly among its recipe's types (none without a target)."""
    target = options.get("target")
    if target not in TARGETS:
        return []
    try:
        types = recipe_types(recipe, options)
    except InputError:  # a job recorded before its options were checked
        return []
    return backend_warnings(types, str(target))


def check_job_input(recipe: str | None, options: Mapping[str, Any] | None) -> JobInput:
    """The recipe and options to record for a job, checked; InputError naming the key and the fix.

    `recipe` None: the target's fast recipe (``target`` option), else tq2_0.
    """
    checked: dict[str, Any] = {}
    for key, value in (options or {}).items():
        checked[key] = _check_value(_option(str(key)), value)
    if recipe is None or not str(recipe).strip():
        name = default_recipe(checked["target"]) if "target" in checked else DEFAULT_RECIPE
    else:
        name = canonical_recipe(str(recipe))
    get_recipe(name, checked)  # what only the recipe knows: levels on q2_0 only, Q1_0's methods, …
    return JobInput(name, checked, tuple(job_warnings(name, checked)))


def _option(key: str) -> Option:
    if key in OPTIONS:
        return OPTIONS[key]
    close = difflib.get_close_matches(key.lower(), OPTIONS, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise InputError(f"unknown option {key!r}; {hint}`bonsai recipes` lists every option")


def _check_value(option: Option, value: Any) -> Any:
    key = option.key
    converted = _convert(option, value)
    if option.choices:
        by_case = {choice.lower(): choice for choice in option.choices}
        if str(converted).lower() not in by_case:
            raise InputError(f"option {key}={value!r}; expected one of {', '.join(option.choices)}")
        converted = by_case[str(converted).lower()]
    if option.kind in ("int", "float"):
        if option.low is not None and converted < option.low:
            raise InputError(f"option {key}={value!r}; expected at least {option.low:g}")
        if option.high is not None and converted > option.high:
            raise InputError(f"option {key}={value!r}; expected at most {option.high:g}")
    if option.check is not None:
        why = option.check(converted)
        if why:
            raise InputError(f"option {key}={value!r}; {why}")
    return converted


def _convert(option: Option, value: Any) -> Any:
    """`value` as the option's kind; the CLI's text is parsed, JSON's numbers are taken as they are."""
    kind, key = option.kind, option.key
    if isinstance(value, str) and kind != "str":
        value = _parse_text(kind, value.strip())
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "int" and is_number and float(value).is_integer():
        return int(value)
    if kind == "float" and is_number:
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "list" and isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    wanted = {"str": "text", "int": "an integer", "float": "a number", "bool": "true or false",
              "list": "a list of names (JSON, or comma-separated)"}[kind]
    raise InputError(f"option {key}={value!r} must be {wanted}")


def _parse_text(kind: str, text: str) -> Any:
    if kind == "bool":
        lowered = text.lower()
        words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
        return words.get(lowered, text)
    if kind == "list":
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return int(text) if kind == "int" else float(text)
    except ValueError:
        try:
            return float(text)  # "3.0" for an integer option: checked as a number
        except ValueError:
            return text

