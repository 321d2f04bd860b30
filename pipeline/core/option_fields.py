"""Job options read into a dataclass's fields by name, each converted to its field's type.

One reader for every settings dataclass whose fields are job options of the same name (the
validate stage's, the llama.cpp probe's): a value of the wrong kind is an InputError that names the
stage, the option and the expected type.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from pipeline.core.errors import InputError

__all__ = ["read_fields"]

_KINDS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


def read_fields(cls: type, options: Mapping[str, Any], who: str,
                skip: Collection[str] = ()) -> dict[str, Any]:
    """The options named like a field of dataclass ``cls`` (less ``skip``), converted to the field's
    type; fields whose type is not a plain str/int/float/bool are left to the caller."""
    values: dict[str, Any] = {}
    for item in fields(cls):
        kind = _KINDS.get(item.type) if isinstance(item.type, str) else item.type
        if item.name in skip or item.name not in options or kind is None or kind not in _KINDS.values():
            continue
        raw = options[item.name]
        if kind is str:
            if not isinstance(raw, str):
                raise InputError(f"{who} option {item.name}={raw!r} must be text")
            values[item.name] = raw
            continue
        try:
            values[item.name] = kind(raw)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{who} option {item.name}={raw!r} is not a {kind.__name__}: {exc}") from exc
    return values
