"""Inspect's cross-check of config.json against the tensor shapes, for every row of `ARCH_SPECS`.

The package stage writes llama.cpp's hyperparameters (embedding length, head counts, head
size, feed-forward length, vocabulary, block count) from config.json, and llama.cpp then
demands every tensor have the shape those numbers imply. A config.json that disagrees with
its own weights would pass decompose and package and fail only when llama.cpp loads the
GGUF; here it is refused before any heavy work, naming the tensor, the shape config.json
implies and the shape found.

A dimension config.json does not state is not checked (the package stage refuses missing
hyperparameters itself); a stated one must be a positive integer. Defaults are the ones the
package stage writes: ``num_key_value_heads`` = ``num_attention_heads``, ``head_dim`` =
``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import gguf

from pipeline.core.errors import InputError
from pipeline.formats.hf.architectures import TRY_SUFFIXES, ArchSpec

__all__ = ["Dims", "check_shapes"]

_BLOCK = re.compile(r"^(.*?(?:^|\.)layers\.)(\d+)(\..+)$")
_LM_HEAD = "lm_head.weight"
_FIX = "config.json disagrees with the checkpoint's weights; use the config.json published with these weights"

# One dimension: (config value or None when unstated, how config.json states it).
_Dim = tuple[int | None, str]


@dataclass(frozen=True)
class Dims:
    """The hyperparameters config.json states (None: not stated, so not checked)."""

    hidden: int | None
    n_head: int | None
    n_kv: int | None
    head_dim: int | None
    intermediate: int | None
    vocab: int | None
    n_layers: int | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Dims:
        """Dims from config.json; InputError for a stated value that is not a positive integer."""
        hidden = _positive(config, "hidden_size")
        n_head = _positive(config, "num_attention_heads")
        n_kv = _positive(config, "num_key_value_heads")
        head_dim = _positive(config, "head_dim")
        if head_dim is None and hidden is not None and n_head is not None:
            head_dim = hidden // n_head
        return cls(
            hidden=hidden,
            n_head=n_head,
            n_kv=n_kv if n_kv is not None else n_head,
            head_dim=head_dim,
            intermediate=_positive(config, "intermediate_size"),
            vocab=_positive(config, "vocab_size"),
            n_layers=_positive(config, "num_hidden_layers"),
        )

    def _product(self, count: int | None, count_key: str) -> _Dim:
        value = None if count is None or self.head_dim is None else count * self.head_dim
        return value, f"{count_key} {count} x head_dim {self.head_dim}"

    def expected(self, kind: str, suffix: str) -> tuple[_Dim, ...] | None:
        """The shape (row-major, as HF stores it) a GGUF tensor kind must have; None if unchecked."""
        hidden: _Dim = (self.hidden, f"hidden_size {self.hidden}")
        inter: _Dim = (self.intermediate, f"intermediate_size {self.intermediate}")
        vocab: _Dim = (self.vocab, f"vocab_size {self.vocab}")
        q_dim = self._product(self.n_head, "num_attention_heads")
        kv_dim = self._product(self.n_kv, "num_key_value_heads")
        head: _Dim = (self.head_dim, f"head_dim {self.head_dim}")
        table: dict[str, tuple[_Dim, ...]] = {
            "token_embd": (vocab, hidden),
            "output": (vocab, hidden),
            "output_norm": (hidden,),
            "attn_norm": (hidden,),
            "ffn_norm": (hidden,),
            "attn_q": (q_dim, hidden),
            "attn_k": (kv_dim, hidden),
            "attn_v": (kv_dim, hidden),
            "attn_output": (hidden, q_dim),
            "ffn_gate": (inter, hidden),
            "ffn_up": (inter, hidden),
            "ffn_down": (hidden, inter),
            "attn_q_norm": (head,),
            "attn_k_norm": (head,),
            # llama.cpp's bitnet loader: attn_sub_norm {n_embd}, ffn_sub_norm {n_ff}.
            "attn_sub_norm": (hidden,),
            "ffn_sub_norm": (inter,),
        }
        shape = table.get(kind)
        if shape is None:
            return None
        if suffix == "bias":
            return shape[:1] if kind in ("attn_q", "attn_k", "attn_v") else None
        return shape


def _positive(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and 0 < value < 2**63:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"config.json key {key!r} is {value!r}; expected a positive integer")
    return value


@functools.lru_cache(maxsize=16)
def _name_map(arch: gguf.MODEL_ARCH) -> gguf.TensorNameMap:
    # One block is enough: block names are matched with their index replaced by 0, so a
    # hostile layer index (or num_hidden_layers) never sizes the table.
    return gguf.get_tensor_name_map(arch, 1)


def _kind(spec: ArchSpec, hf_name: str) -> tuple[int | None, str, str] | None:
    """(layer index or None, GGUF kind such as ``attn_q``, ``weight``/``bias``), or None if unmapped."""
    if hf_name == _LM_HEAD:
        return None, "output", "weight"
    match = _BLOCK.match(hf_name)
    layer = int(match.group(2)) if match else None
    probe = f"{match.group(1)}0{match.group(3)}" if match else hf_name
    gguf_name = _name_map(spec.gguf_arch).get_name(probe, try_suffixes=TRY_SUFFIXES)
    if gguf_name is None and match:
        rest = match.group(3)[1:]
        if rest in spec.extra_names:
            gguf_name = f"blk.0.{spec.extra_names[rest]}.{rest.rsplit('.', 1)[-1]}"
    if gguf_name is None:
        return None
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) >= 4:
        return layer, ".".join(parts[2:-1]), parts[-1]
    return None, ".".join(parts[:-1]), parts[-1]


def _check_layers(dims: Dims, layers: Mapping[int, str]) -> None:
    if dims.n_layers is None or not layers:
        return
    top = max(layers)
    if top >= dims.n_layers:
        raise InputError(
            f"tensor {layers[top]!r} belongs to layer {top}, but config.json num_hidden_layers is "
            f"{dims.n_layers} (layers 0..{dims.n_layers - 1}): expected {dims.n_layers} layer(s), found "
            f"at least {top + 1}; {_FIX}"
        )
    missing = [i for i in range(dims.n_layers) if i not in layers]
    if missing:
        sample = re.sub(r"layers\.\d+\.", f"layers.{missing[0]}.", layers[min(layers)], count=1)
        raise InputError(
            f"config.json num_hidden_layers is {dims.n_layers} but no tensor belongs to layer {missing[0]} "
            f"(expected e.g. {sample!r}): expected {dims.n_layers} layer(s), found {len(layers)}; {_FIX}"
        )


def check_shapes(
    spec: ArchSpec, config: Mapping[str, Any], tensors: Iterable[tuple[str, tuple[int, ...]]]
) -> None:
    """Refuse tensors whose shapes disagree with config.json's hyperparameters for `spec`.

    `tensors` are (HF name, row-major shape). Raises InputError naming the tensor, the shape
    config.json implies (and which keys imply it) and the shape found; or the layer count
    config.json states against the layers the tensor names hold.
    """
    dims = Dims.from_config(config)
    layers: dict[int, str] = {}
    for name, shape in tensors:
        kind = _kind(spec, name)
        if kind is None:
            continue  # a name llama.cpp has no slot for: the package stage's plan names it
        layer, base, suffix = kind
        if layer is not None:
            layers.setdefault(layer, name)
        expected = dims.expected(base, suffix)
        if expected is None:
            continue
        _compare(name, tuple(shape), expected)
    _check_layers(dims, layers)


def _compare(name: str, shape: tuple[int, ...], expected: tuple[_Dim, ...]) -> None:
    shown = [str(value) if value is not None else "?" for value, _ in expected]
    wrong = [
        f"dimension {axis} is {shape[axis]}, not {value} ({how})"
        for axis, (value, how) in enumerate(expected)
        if value is not None and axis < len(shape) and shape[axis] != value
    ]
    if len(shape) != len(expected):
        wrong.insert(0, f"{len(shape)} dimensions instead of {len(expected)}")
    if wrong:
        raise InputError(
            f"tensor {name!r}: expected shape [{', '.join(shown)}] from config.json, found {list(shape)} "
            f"({'; '.join(wrong)}); {_FIX}"
        )
