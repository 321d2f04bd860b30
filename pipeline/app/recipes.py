"""What `bonsai recipes` and `bonsai convert --help` list: every recipe and job option, from their tables."""

from __future__ import annotations

from typing import Any

__all__ = ["recipe_rows", "option_rows", "help_text"]

_LEVEL = {"none": "no kernel (runs on the CPU)", "scalar": "scalar code only (slow)", "partial": "partly"}


def recipe_rows() -> list[dict[str, Any]]:
    """One row per recipe: its GGUF type, bits per weight, block, and how each backend runs it."""
    from pipeline.formats.gguf.types import block_geometry
    from pipeline.stages.options import DEFAULT_RECIPE
    from pipeline.ternary.backends import TARGETS, default_recipe, support
    from pipeline.ternary.policy import RECIPES

    rows = []
    for name, recipe in RECIPES.items():
        block, size = block_geometry(recipe.ternary_type)
        rows.append({
            "name": name,
            "ggml_type": recipe.ternary_type,
            "bits_per_weight": round(8 * size / block, 4),
            "block": block,
            "backends": {target: support(recipe.ternary_type, target).value for target in TARGETS},
            "is_default": name == DEFAULT_RECIPE,
            "default_for": [t for t in TARGETS if default_recipe(t) == name],
        })
    return rows


def option_rows() -> list[dict[str, Any]]:
    """One row per job option: key, stage that reads it, kind, default, allowed values, help."""
    from pipeline.stages.options import OPTIONS

    return [{"key": o.key, "stage": o.stage, "kind": o.kind, "default": o.default, "choices": list(o.choices),
             "low": o.low, "high": o.high, "help": o.help} for o in OPTIONS.values()]


def _allowed(row: dict[str, Any]) -> str:
    if row["choices"]:
        return "|".join(row["choices"])
    if row["low"] is not None or row["high"] is not None:
        low = "" if row["low"] is None else f"{row['low']:g}"
        high = "" if row["high"] is None else f"{row['high']:g}"
        return f"{row['kind']} {low}..{high}"
    return str(row["kind"])


def help_text() -> str:
    """Plain lines for a command's help: recipes, then options grouped by stage."""
    lines = ["Recipes (any case; llama.cpp's spellings such as TQ2_0 work too):", ""]
    for row in recipe_rows():
        slow = [f"{t}: {_LEVEL[level]}" for t, level in row["backends"].items() if level != "fast"]
        note = f"; {', '.join(slow)}" if slow else ""
        default = "; the default" if row["is_default"] else ""
        if row["default_for"]:
            default += f"; picked by --target {', '.join(row['default_for'])}"
        lines.append(f"  {row['name']:<7} {row['ggml_type']}, {row['bits_per_weight']:g} bpw, blocks of "
                     f"{row['block']}{note}{default}")
    lines += ["", "Options (--option KEY=VALUE; type names in any case):", ""]
    for row in option_rows():
        default = "" if row["default"] is None else f" [default: {row['default']}]"
        lines.append(f"  {row['key']} ({row['stage']}, {_allowed(row)}): {row['help']}{default}")
    return "\n".join(lines)
