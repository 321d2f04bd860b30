"""Input Gram matrices XᵀX on disk: one safetensors file per transformer block.

A Gram matrix is ``cols²`` numbers per weight (an 11008-wide ffn_down input is 485 MB in
float32), so they are written a block at a time, as the torch collector finishes each block,
and read back one weight at a time by the fit that needs it. Stored as float32 (accumulated in
float64; float32 keeps 7 significant digits, more than an error-compensating fit resolves).
Weights that read the same input (q/k/v, gate/up) get bit-identical matrices; each distinct
matrix is stored once and the others point at it.

File layout: tensors ``<stored weight name>.gram`` (F32 [cols, cols]); safetensors metadata
``bonsai.gram`` = JSON ``{"format": "bonsai-gram/1", "weights": {name: {"stored": name,
"count": tokens}}}``. File names: ``blk.<i>.safetensors``, ``global.safetensors`` for weights
outside blocks.

Example::

    path = write_gram_file(workdir / "gram" / "blk.0.safetensors", stats.take_grams(names))
    gram, count = GramFile(path).read("blk.0.attn_k.weight")
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from pipeline.core.errors import IntegrityError

__all__ = ["GRAM_FORMAT", "gram_file_name", "write_gram_file", "GramFile"]

GRAM_FORMAT = "bonsai-gram/1"
_META_KEY = "bonsai.gram"
_SUFFIX = ".gram"
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def gram_file_name(weight_name: str) -> str:
    """The file a weight's Gram matrix lives in: ``blk.<i>.safetensors`` or ``global.safetensors``."""
    match = _BLOCK.match(weight_name)
    return f"blk.{match.group(1)}.safetensors" if match else "global.safetensors"


def write_gram_file(dest: Path, grams: Mapping[str, tuple[torch.Tensor, int]]) -> Path:
    """Write name -> (gram [cols, cols], token count) at ``dest`` (replaced atomically); returns ``dest``.

    Identical matrices are stored once. Raises ValueError for a matrix that is not square.
    """
    from safetensors.torch import save_file

    stored: dict[str, torch.Tensor] = {}
    weights: dict[str, dict[str, object]] = {}
    for name, (gram, count) in grams.items():
        if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
            raise ValueError(f"Gram matrix of {name!r} has shape {tuple(gram.shape)}; expected square")
        matrix = gram.to(torch.float32).cpu().contiguous()
        same = next(
            (k for k, v in stored.items() if v.shape == matrix.shape and torch.equal(v, matrix)), None
        )
        key = same or name
        if same is None:
            stored[name] = matrix
        weights[name] = {"stored": key, "count": int(count)}
    meta = {_META_KEY: json.dumps({"format": GRAM_FORMAT, "weights": weights}, sort_keys=True)}
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    save_file({k + _SUFFIX: v for k, v in stored.items()}, str(tmp), metadata=meta)
    os.replace(tmp, dest)
    return dest


class GramFile:
    """One Gram file opened for reading; `read` loads one weight's matrix."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                raw = (handle.metadata() or {}).get(_META_KEY)
                keys = set(handle.keys())
        except (OSError, ValueError, RuntimeError) as exc:
            raise IntegrityError(
                f"Gram file {self.path.name} is not a readable safetensors file: {exc}"
            ) from exc
        try:
            meta = json.loads(raw or "")
        except ValueError as exc:
            raise IntegrityError(f"Gram file {self.path.name} has no valid {_META_KEY} metadata") from exc
        if meta.get("format") != GRAM_FORMAT:
            raise IntegrityError(
                f"Gram file {self.path.name} is {meta.get('format')!r}, expected {GRAM_FORMAT!r}"
            )
        self.weights: dict[str, dict[str, object]] = dict(meta.get("weights") or {})
        missing = sorted(n for n, w in self.weights.items() if f"{w.get('stored')}{_SUFFIX}" not in keys)
        if missing:
            raise IntegrityError(f"Gram file {self.path.name} names matrices it lacks: {missing[:5]}")

    def names(self) -> list[str]:
        """The weights this file holds a matrix for."""
        return sorted(self.weights)

    def read(self, name: str) -> tuple[torch.Tensor, int]:
        """(Gram matrix float32 [cols, cols], token count) of weight ``name``; KeyError when absent."""
        from safetensors import safe_open

        info = self.weights[name]
        with safe_open(str(self.path), framework="pt") as handle:
            gram = handle.get_tensor(f"{info['stored']}{_SUFFIX}")
        count = info["count"]
        return gram, int(count) if isinstance(count, int) else 0
