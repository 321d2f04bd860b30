"""The model card: what the inspect stage learned about a checkpoint, and what later stages rely on.

One dataclass, one `load` (size-capped, IntegrityError naming the file and the fix) and one
`write` (atomic, re-read). The JSON shape is stable (other tools read it)::

    {"architecture": "llama", "hf_architecture": "LlamaForCausalLM", "config": {...},
     "format": "safetensors", "shards": ["model.safetensors"],
     "tensors": [{"name": ..., "shape": [...], "dtype": "BF16", "shard": ...}],
     "param_count": 123, "dtypes": {"BF16": 20},
     "tokenizer": {"kind": "bpe" | "sentencepiece" | None, "files": [...]}}

A GGUF source's card has ``"format": "gguf"``, ``hf_architecture`` null, the file's metadata as
``config`` and its ``file_type`` (llama.cpp's name, such as ``MOSTLY_Q4_K_M``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.files import write_json
from pipeline.formats.jsonfile import load_json

__all__ = ["CARD_NAME", "CardTensor", "TokenizerInfo", "ModelCard"]

CARD_NAME = "model_card.json"
_MAX_CARD_BYTES = 64 * 1024 * 1024
_FORMATS = ("safetensors", "gguf")
_FIX = "it is not a model card this version wrote; retry the job from inspect"


@dataclass(frozen=True)
class CardTensor:
    """One source tensor: its name in the checkpoint, shape (row-major), stored dtype and file."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: str

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer family (``bpe``, ``sentencepiece`` or unknown) and the files that carry it."""

    kind: str | None
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelCard:
    """A checked description of a checkpoint (no tensor data)."""

    architecture: str
    hf_architecture: str | None
    config: Mapping[str, Any]
    format: str
    shards: tuple[str, ...]
    tensors: tuple[CardTensor, ...]
    param_count: int
    dtypes: Mapping[str, int]
    tokenizer: TokenizerInfo = field(default_factory=lambda: TokenizerInfo(None))
    file_type: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.format == "gguf"

    @property
    def embedding_rows(self) -> int:
        """Rows of an HF checkpoint's token embedding (its vocabulary as the model computes it); 0 if none."""
        return max((t.shape[0] for t in self.tensors if t.name.endswith("embed_tokens.weight")), default=0)

    def to_dict(self) -> dict[str, Any]:
        """The card's JSON document (key order is part of its bytes, and so of its digest)."""
        document: dict[str, Any] = {
            "architecture": self.architecture,
            "hf_architecture": self.hf_architecture,
            "config": dict(self.config),
            "format": self.format,
            "shards": list(self.shards),
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "shard": t.shard}
                        for t in self.tensors],
            "param_count": self.param_count,
            "dtypes": dict(self.dtypes),
        }
        if self.is_gguf:
            document["file_type"] = self.file_type
        document["tokenizer"] = {"kind": self.tokenizer.kind, "files": list(self.tokenizer.files)}
        return document

    def write(self, path: Path) -> str:
        """Write the card atomically at `path` and re-read it; returns the JSON text."""
        return write_json(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: Path, label: str = CARD_NAME) -> ModelCard:
        """Read and check a card file; IntegrityError naming `label` when it is not a sound card."""
        document = load_json(path, label, max_bytes=_MAX_CARD_BYTES, error=IntegrityError, fix=_FIX)
        return cls.from_dict(document, label)

    @classmethod
    def from_dict(cls, document: Any, label: str = CARD_NAME) -> ModelCard:
        """A card from its JSON document; IntegrityError naming the first field at fault."""
        if not isinstance(document, Mapping):
            raise IntegrityError(f"{label}: holds {type(document).__name__}, expected an object; {_FIX}")
        fmt = _field(document, "format", str, label)
        if fmt not in _FORMATS:
            raise IntegrityError(f"{label}: format {fmt!r} is not one of {', '.join(_FORMATS)}; {_FIX}")
        shards = _strings(document.get("shards"), "shards", label)
        tensors = tuple(_tensor(entry, i, label) for i, entry in enumerate(_list(document, "tensors", label)))
        hf_architecture = document.get("hf_architecture")
        if hf_architecture is not None and not isinstance(hf_architecture, str):
            raise IntegrityError(f"{label}: hf_architecture must be a string or null; {_FIX}")
        config = document.get("config") or {}
        if not isinstance(config, Mapping):
            raise IntegrityError(f"{label}: config must be an object; {_FIX}")
        dtypes = document.get("dtypes") or {}
        if not isinstance(dtypes, Mapping):
            raise IntegrityError(f"{label}: dtypes must be an object; {_FIX}")
        param_count = document.get("param_count", sum(t.numel for t in tensors))
        if not isinstance(param_count, int) or isinstance(param_count, bool):
            raise IntegrityError(f"{label}: param_count must be an integer; {_FIX}")
        file_type = document.get("file_type")
        return cls(
            architecture=_field(document, "architecture", str, label),
            hf_architecture=hf_architecture,
            config=config,
            format=fmt,
            shards=shards,
            tensors=tensors,
            param_count=param_count,
            dtypes=dict(dtypes),
            tokenizer=_tokenizer(document.get("tokenizer"), label),
            file_type=file_type if isinstance(file_type, str) else None,
        )

    def tensors_in(self, shard: str) -> tuple[CardTensor, ...]:
        """The card's tensors stored in `shard`, in card order."""
        return tuple(t for t in self.tensors if t.shard == shard)


def _field(document: Mapping[str, Any], key: str, kind: type, label: str) -> Any:
    value = document.get(key)
    if not isinstance(value, kind):
        raise IntegrityError(f"{label}: {key} must be a {kind.__name__}, got {value!r}; {_FIX}")
    return value


def _list(document: Mapping[str, Any], key: str, label: str) -> list[Any]:
    value = document.get(key)
    if not isinstance(value, list):
        raise IntegrityError(f"{label}: {key} must be a list; {_FIX}")
    return value


def _strings(value: Any, key: str, label: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise IntegrityError(f"{label}: {key} must be a list of strings; {_FIX}")
    return tuple(value)


def _tensor(entry: Any, index: int, label: str) -> CardTensor:
    if not isinstance(entry, Mapping):
        raise IntegrityError(f"{label}: tensors[{index}] is not an object; {_FIX}")
    name, dtype, shard, shape = entry.get("name"), entry.get("dtype"), entry.get("shard"), entry.get("shape")
    if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shard, str):
        raise IntegrityError(f"{label}: tensors[{index}] needs string name, dtype and shard; {_FIX}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise IntegrityError(f"{label}: tensor {name!r} has shape {shape!r}; expected a list of ints; {_FIX}")
    return CardTensor(name, tuple(shape), dtype, shard)


def _tokenizer(value: Any, label: str) -> TokenizerInfo:
    if value is None:
        return TokenizerInfo(None)
    if not isinstance(value, Mapping):
        raise IntegrityError(f"{label}: tokenizer must be an object; {_FIX}")
    kind = value.get("kind")
    if kind is not None and not isinstance(kind, str):
        raise IntegrityError(f"{label}: tokenizer.kind must be a string or null; {_FIX}")
    return TokenizerInfo(kind, _strings(value.get("files") or [], "tokenizer.files", label))
