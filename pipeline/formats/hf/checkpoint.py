"""Source side of packaging: which HF tensors become which GGUF tensors, and their data.

`tensor_plan` decides names and shapes from the model card alone (no tensor data read),
so a bad checkpoint is refused before any heavy work. `iter_tensors` then streams one
shard's tensors, one at a time, already in the layout llama.cpp expects (float32,
q/k rows permuted for rope where the architecture's rope needs it, BitNet's latent
weights rounded to the ternary values the model computes with). Per-architecture rules
come from the `names.ARCH_SPECS` table.

Both read the `ModelCard` the inspect stage writes (`pipeline.formats.model_card`).

Example::

    plan = tensor_plan(card)
    for gguf_name, weight in iter_tensors(card, {"model.safetensors": path}, "model.safetensors"):
        ...
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.hf.architectures import (
    ARCHITECTURES,
    REQUIRED_GLOBAL,
    ROPE_PERMUTED,
    SKIPPED_SUFFIXES,
    TERNARY_LATENT_KINDS,
    TRY_SUFFIXES,
    ArchSpec,
)
from pipeline.formats.model_card import ModelCard
from pipeline.formats.plan import PlannedTensor

if TYPE_CHECKING:
    import torch  # loaded where tensors are made: the plan and the package stage need no torch

__all__ = ["PlannedTensor", "arch_spec", "tensor_plan", "iter_tensors", "is_stored_as_is", "rope_permute",
           "bitnet_weight_quant"]

_LM_HEAD = "lm_head.weight"
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_LATENT = re.compile(r"^blk\.\d+\.(" + "|".join(TERNARY_LATENT_KINDS) + r")\.weight$")


def arch_spec(card: ModelCard) -> ArchSpec:
    """The packaging rules for the card's architecture; InputError if we do not package it."""
    for key in (card.hf_architecture, card.architecture):
        if isinstance(key, str) and key in ARCHITECTURES:
            return ARCHITECTURES[key]
    raise InputError(
        f"architecture {card.hf_architecture!r} (model_type {card.architecture!r}) "
        f"is not one Bonsai packages; supported: {sorted(ARCHITECTURES)}"
    )


def _config_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"config.json key {key!r} is {value!r}; expected a positive integer")
    return value


def _head_count(config: Mapping[str, Any], key: str) -> int:
    # GQA-less configs omit num_key_value_heads: it then equals the attention head count.
    default = config.get("num_attention_heads") if key == "num_key_value_heads" else None
    return _config_int(config, key, default)


def _check_permutable(hf_name: str, shape: tuple[int, ...], n_head: int) -> None:
    if not shape or shape[0] % (2 * n_head):
        raise InputError(
            f"tensor {hf_name!r} has shape {list(shape)}: its {shape[0] if shape else 0} rows do not split "
            f"into {n_head} heads of even size, so the rope permutation llama.cpp needs is impossible"
        )


def _check_coverage(spec: ArchSpec, planned: list[PlannedTensor], n_blocks: int) -> None:
    have = {p.gguf_name for p in planned}
    per_block = spec.required_per_block
    expected = list(REQUIRED_GLOBAL) + [f"blk.{b}.{n}" for b in range(n_blocks) for n in per_block]
    missing = [name for name in expected if name not in have]
    if missing:
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        raise InputError(
            f"the checkpoint lacks {len(missing)} tensor(s) llama.cpp's {spec.gguf_name} loader needs: "
            f"{shown}; check num_hidden_layers in config.json and that every shard was downloaded"
        )


def _check_config(spec: ArchSpec, config: Mapping[str, Any]) -> None:
    """Refuse config settings llama.cpp's graph for this architecture does not compute."""
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act not in spec.activations:
        raise InputError(
            f"config.json hidden_act {act!r}: llama.cpp's {spec.gguf_name} graph computes "
            f"{', '.join(spec.activations)} only, so the converted model would compute something else"
        )
    if config.get("use_sliding_window") is True:
        raise InputError(
            f"config.json use_sliding_window is true: llama.cpp's {spec.gguf_name} graph attends over "
            "the whole context; convert only models trained without sliding-window attention"
        )


def _gguf_name(
    spec: ArchSpec, name_map: gguf.TensorNameMap, hf_name: str, n_blocks: int
) -> str | None:
    """GGUF name from gguf's TensorNameMap, else from the spec's own `extra_names`."""
    gguf_name = name_map.get_name(hf_name, try_suffixes=TRY_SUFFIXES)
    if gguf_name is not None:
        return gguf_name
    match = _BLOCK.search(hf_name)
    if match and int(match.group(1)) < n_blocks and match.group(2) in spec.extra_names:
        suffix = match.group(2).rsplit(".", 1)[-1]
        return f"blk.{match.group(1)}.{spec.extra_names[match.group(2)]}.{suffix}"
    return None


def _skips_output_head(spec: ArchSpec, config: Mapping[str, Any], hf_name: str) -> bool:
    """True for an lm_head the architecture has no slot for but that only repeats the embedding."""
    if spec.has_output_head or hf_name != _LM_HEAD:
        return False
    if config.get("tie_word_embeddings") is True:
        return True  # a saved copy of the tied embedding: llama.cpp reuses token_embd
    raise InputError(
        f"tensor {_LM_HEAD!r}: llama.cpp's {spec.gguf_name} graph always uses token_embd as the output "
        "head, so an untied lm_head (config.json tie_word_embeddings is not true) cannot be represented"
    )


@functools.lru_cache(maxsize=8)
def _tensor_name_map(arch: Any, n_blocks: int) -> Any:
    """gguf's HF -> GGUF name map, built once per architecture and depth: building it takes ~40 ms
    for 24 blocks, and a job plans the same checkpoint several times (decompose, each shard's
    stream, package, calibrate's source GGUF). Only read from, so one instance serves them all."""
    return gguf.get_tensor_name_map(arch, n_blocks)


def tensor_plan(card: ModelCard) -> list[PlannedTensor]:
    """Map every tensor of the card to its GGUF name, in card order; reads no tensor data.

    Raises InputError for an unsupported architecture, a tensor name llama.cpp has no
    slot for (named in the message), two tensors landing on one GGUF name, a shard the
    card does not list, q/k rows that cannot be rope-permuted, or missing required tensors.
    """
    spec = arch_spec(card)
    config = card.config
    _check_config(spec, config)
    n_blocks = _config_int(config, "num_hidden_layers")
    name_map = _tensor_name_map(spec.gguf_arch, n_blocks)
    shards = set(card.shards)
    planned: list[PlannedTensor] = []
    seen: dict[str, str] = {}
    for entry in card.tensors:
        hf_name = entry.name
        if hf_name.endswith(SKIPPED_SUFFIXES) or _skips_output_head(spec, config, hf_name):
            continue
        gguf_name = _gguf_name(spec, name_map, hf_name, n_blocks)
        if gguf_name is None:
            raise InputError(
                f"tensor {hf_name!r} has no GGUF name for architecture {spec.gguf_name!r} "
                f"({n_blocks} blocks); the checkpoint holds tensors llama.cpp would not load"
            )
        if gguf_name in seen:
            raise InputError(f"tensors {seen[gguf_name]!r} and {hf_name!r} both map to GGUF {gguf_name!r}")
        shard = entry.shard
        if shard not in shards:
            raise InputError(f"tensor {hf_name!r} lives in shard {shard!r}, which the card's shards omit")
        shape = entry.shape
        if spec.has_rope_permute:
            for suffix, head_key in ROPE_PERMUTED.items():
                if hf_name.endswith(suffix):
                    _check_permutable(hf_name, shape, _head_count(config, head_key))
        seen[gguf_name] = hf_name
        planned.append(PlannedTensor(gguf_name, hf_name, shape, entry.dtype, shard))
    _check_coverage(spec, planned, n_blocks)
    return planned


def rope_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder q/k rows from HF's rotate-half rope layout to GGML's adjacent-pair layout.

    Within each head the rows [r0..r(d/2-1) | r(d/2)..r(d-1)] become interleaved
    pairs (r0, r(d/2)), (r1, r(d/2+1)), …: the same reordering llama.cpp's converter
    applies to Llama q_proj (by attention heads) and k_proj (by KV heads).
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def bitnet_weight_quant(weight: torch.Tensor) -> torch.Tensor:
    """BitNet b1.58's run-time weight rounding: ``mean(|W|) * clamp(round(W / mean(|W|)), -1, 1)``.

    One scale per tensor (clamped at 1e-5 like the reference code), float32 in and out. The
    model computes with these values, not with its stored latent weights, so they are what
    the GGUF must hold; the result is exactly scale x {-1, 0, +1}, which decomposition keeps.
    """
    scale = weight.abs().mean().clamp(min=1e-5)
    return (weight / scale).round().clamp(-1, 1) * scale


def _permute_heads(spec: ArchSpec, config: Mapping[str, Any], hf_name: str) -> int | None:
    if not spec.has_rope_permute:
        return None
    for suffix, head_key in ROPE_PERMUTED.items():
        if hf_name.endswith(suffix):
            return _head_count(config, head_key)
    return None


def is_stored_as_is(card: ModelCard, gguf_name: str, hf_name: str) -> bool:
    """Whether `iter_tensors` hands this tensor out as its stored values, in stored row order (no
    q/k permutation, no BitNet rounding): its bytes can be copied file to file."""
    spec = arch_spec(card)
    latent = spec.ternary_latent and _LATENT.match(gguf_name)
    return not latent and _permute_heads(spec, card.config, hf_name) is None


def iter_tensors(
    card: ModelCard, files: Mapping[str, Path], shard: str, *, as_stored: bool = False,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (gguf_name, float32 contiguous tensor) for every planned tensor of one shard.

    Each tensor's bytes are read on their own (q/k rows land permuted) into reused buffers,
    so peak memory is a few tensors whatever the shard size; a yielded tensor's memory is
    reused only once the caller has dropped it. `files` maps shard names to local paths.
    ``as_stored``: BF16/F16 tensors come as stored, not converted, unless values are computed
    from them (BitNet's rounding); a caller that converts as it goes saves a pass and the
    memory of a float32 copy. ``skip``: GGUF names checked against the file but not read or yielded.
    Raises InputError when the shard is unknown or its file missing, IntegrityError when
    the file's tensors disagree with the card (absent, other shape) or its header is invalid.
    """
    import torch

    from pipeline.formats.rawio import SafetensorsReader

    spec = arch_spec(card)
    config = card.config
    planned = [p for p in tensor_plan(card) if p.shard == shard]
    if not planned:
        raise InputError(f"shard {shard!r} holds no planned tensors; card shards: {list(card.shards)}")
    path = files.get(shard)
    if path is None or not Path(path).is_file():
        raise InputError(f"shard {shard!r} is not among the input files ({sorted(files)})")
    with SafetensorsReader(Path(path)) as reader:
        for item in planned:
            if item.hf_name not in reader.entries:
                raise IntegrityError(
                    f"tensor {item.hf_name!r} is in the model card but not in shard {shard!r}"
                )
            stored_shape = reader.entries[item.hf_name].shape
            if stored_shape != item.shape:
                raise IntegrityError(
                    f"tensor {item.hf_name!r} in {shard!r} has shape {list(stored_shape)}; "
                    f"the model card says {list(item.shape)}"
                )
            if item.gguf_name in skip:
                continue
            n_head = _permute_heads(spec, config, item.hf_name)
            rows = None if n_head is None else rope_permute(torch.arange(item.shape[0]), n_head)
            latent = spec.ternary_latent and _LATENT.match(item.gguf_name)
            tensor = reader.tensor(item.hf_name, row_order=rows, as_stored=as_stored and not latent)
            if latent:
                tensor = bitnet_weight_quant(tensor)
            yield item.gguf_name, tensor.contiguous()
            del tensor
