"""The one way JSON files are read here: size-capped, UTF-8, one error type, a message that says what to do.

Checkpoint JSON (config.json, tokenizer.json) comes from strangers, and our own stage
documents (model card, manifest, reports) pass through storage: both are read with a size
cap checked before the bytes are, so a multi-GB "config.json" costs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pipeline.core.errors import InputError, PipelineError

__all__ = ["load_json", "as_dataclass", "ShapeError", "MAX_JSON_BYTES"]

T = TypeVar("T")

# tokenizer.json of a 256k-token vocabulary is ~30 MB; nothing legitimate comes near this.
MAX_JSON_BYTES = 256 * 1024 * 1024


def load_json(
    path: Path,
    label: str,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    error: type[PipelineError] = InputError,
    fix: str = "",
) -> Any:
    """Parse the JSON file at `path`; raises `error` naming `label`, the problem and `fix`.

    Duplicate keys are allowed (JSON allows them; the last wins, as json.loads does).
    """
    hint = f"; {fix}" if fix else ""
    try:
        with open(path, "rb") as handle:
            size_bytes = os.fstat(handle.fileno()).st_size
            if size_bytes > max_bytes:
                raise error(f"{label}: {size_bytes:,} bytes is over the {max_bytes:,}-byte limit for this "
                            f"file{hint}")
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror or exc}){hint}") from exc
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{label}: not UTF-8 text (byte {exc.start}){hint}") from exc
    except RecursionError as exc:
        raise error(f"{label}: nested too deeply to be a JSON document here{hint}") from exc
    except ValueError as exc:
        raise error(f"{label}: not valid JSON ({exc}){hint}") from exc


class ShapeError(ValueError):
    """A document that is not the dataclass it should be; its text names the first problems and where."""


def as_dataclass(cls: type[T], document: Any, most: int = 3) -> T:
    """A parsed JSON document as dataclass ``cls``, nested dataclasses, tuples and mappings included,
    each value checked against its field's type; ShapeError naming up to ``most`` problems."""
    from pydantic import TypeAdapter, ValidationError

    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    try:
        return adapter.validate_python(document)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise ShapeError("; ".join(f"{'.'.join(map(str, e['loc'])) or 'the document'}: {e['msg']}"
                                   for e in exc.errors()[:most])) from None


# Built on first use and kept: pydantic compiles a whole dataclass tree into one validator.
_ADAPTERS: dict[type, Any] = {}
