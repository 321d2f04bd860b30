"""Job options declared on the dataclass fields that hold them, and read into them by name.

Each option is declared once, on its field: `option(default, help=..., low=..., high=...,
choices=...)` puts an `OptionDoc` in the field's metadata; `declared` lists them (the options
table that `bonsai recipes`, the CLI, manifests and the API read is made from it), and
`read_fields` reads a job's options into those fields: a value of the wrong kind is an
InputError that names the stage, the option and the expected type.

Example::

    @dataclass(frozen=True)
    class Params:
        n_ctx: int = option(256, help="llama.cpp context size", low=16)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from pipeline.core.errors import InputError

__all__ = ["OptionDoc", "DeclaredOption", "option", "declared", "read_fields"]

_KEY = "bonsai_option"
# The field types an option may have, and the kind the options table names for each.
_KIND_OF_TYPE = {"str": "str", "int": "int", "float": "float", "bool": "bool", "str | None": "str",
                 "int | None": "int", "float | None": "float", "tuple[str, ...]": "list"}


class _FromField:
    def __repr__(self) -> str:
        return "the field's default"


FROM_FIELD: Any = _FromField()


@dataclass(frozen=True)
class OptionDoc:
    """What the options table says of a field's option. ``key``: the option's name when it is not
    the field's. ``shown_default``: the table's default when the field's is not what a user sees
    (None: worked out, said in ``help``). ``check``: why a value is refused, or None."""

    help: str
    key: str = ""
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    shown_default: Any = FROM_FIELD
    check: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class DeclaredOption:
    """One option as a dataclass declares it: its key, the field holding it, kind, default, doc."""

    key: str
    field_name: str
    kind: str
    default: Any
    doc: OptionDoc


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING, **doc: Any) -> Any:
    """A dataclass field that is a job option; ``doc`` holds `OptionDoc`'s other fields."""
    metadata = {_KEY: OptionDoc(help, **doc)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def declared(cls: type) -> list[DeclaredOption]:
    """Every option dataclass ``cls`` declares, in field order."""
    found = []
    for item in fields(cls):
        doc = item.metadata.get(_KEY)
        if doc is None:
            continue
        kind = _KIND_OF_TYPE.get(str(item.type))
        if kind is None:
            raise TypeError(f"{cls.__name__}.{item.name}: an option's field type must be one of "
                            f"{sorted(_KIND_OF_TYPE)}")
        default = _default(item) if doc.shown_default is FROM_FIELD else doc.shown_default
        found.append(DeclaredOption(doc.key or item.name, item.name, kind, default, doc))
    return found


def _default(item: Field[Any]) -> Any:
    if item.default is not MISSING:
        return list(item.default) if isinstance(item.default, tuple) else item.default
    return item.default_factory() if item.default_factory is not MISSING else None


# The kinds `read_fields` converts a value to (a list field is left to its stage).
_CONVERTERS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


def read_fields(cls: type, options: Mapping[str, Any], who: str,
                skip: Collection[str] = ()) -> dict[str, Any]:
    """The options naming a field of dataclass ``cls`` (by its declared key, else its name; less
    ``skip``), converted to the field's type and held to its declared bounds and choices; fields
    whose type is not a plain str/int/float/bool are left to the caller."""
    values: dict[str, Any] = {}
    for item in fields(cls):
        doc: OptionDoc | None = item.metadata.get(_KEY)
        key = (doc.key if doc else "") or item.name
        kind = _CONVERTERS.get(_KIND_OF_TYPE.get(str(item.type), ""))
        if item.name in skip or key not in options or kind is None:
            continue
        raw = options[key]
        if kind is str:
            if not isinstance(raw, str):
                raise InputError(f"{who} option {key}={raw!r} must be text")
            value: Any = raw
        else:
            try:
                value = kind(raw)
            except (TypeError, ValueError) as exc:
                raise InputError(f"{who} option {key}={raw!r} is not a {kind.__name__}: {exc}") from exc
        if doc is not None:
            _within(doc, key, value, who)
        values[item.name] = value
    return values


def _within(doc: OptionDoc, key: str, value: Any, who: str) -> None:
    if doc.choices and value not in doc.choices:
        raise InputError(f"{who} option {key}={value!r}; expected one of {', '.join(doc.choices)}")
    if doc.low is not None and value < doc.low:
        raise InputError(f"{who} option {key}={value!r} is out of range: expected at least {doc.low:g}")
    if doc.high is not None and value > doc.high:
        raise InputError(f"{who} option {key}={value!r} is out of range: expected at most {doc.high:g}")
