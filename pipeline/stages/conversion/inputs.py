"""What a fitting stage (decompose, sensitivity) reads first: the card, the source's tensor reader,
the device it fits on, and the memory that takes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import InputError
from pipeline.formats.model_card import CARD_NAME, ModelCard
from pipeline.stages.base import InputFile, MemoryNeed

if TYPE_CHECKING:
    import torch

__all__ = ["device_fault", "resolve_device", "load_card", "source_module", "fit_memory_need"]

_BASE_BYTES = 512 << 20


def device_fault(value: str) -> str | None:
    """Why `value` is no device name, or None when it is one."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return None
    return "expected auto, cpu, cuda or cuda:N"


def resolve_device(device: str) -> torch.device:
    """The torch device for a checked device name: "auto" is CUDA when available, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {device!r} requested but CUDA is not available on this worker")
    return torch.device(device)


def load_card(inputs: Mapping[str, InputFile], stage: str) -> ModelCard:
    """Inspect's card among ``stage``'s inputs; InputError naming them when it is missing."""
    item = inputs.get(f"inspect/{CARD_NAME}")
    if item is None:
        raise InputError(f"{stage} needs inspect/{CARD_NAME}; inputs were {sorted(inputs)}")
    return ModelCard.load(item.path, f"inspect/{CARD_NAME}")


def source_module(card: ModelCard) -> Any:
    """Where tensors come from: a GGUF file (names and llama.cpp layout as stored, dequantized)
    or an HF checkpoint (renamed, q/k permuted). Both offer tensor_plan(card) and iter_tensors."""
    from pipeline.formats.gguf import tensor_source as gguf_source

    if gguf_source.is_gguf_card(card):
        return gguf_source
    from pipeline.formats.hf import checkpoint as source

    return source


def fit_memory_need(inputs: Mapping[str, InputFile], stage: str) -> MemoryNeed | None:
    """Tensors stream one at a time: a few float32 copies of the largest one (source, fit, codes)."""
    if f"inspect/{CARD_NAME}" not in inputs or not (card := load_card(inputs, stage)).tensors:
        return None
    largest = max(card.tensors, key=lambda tensor: tensor.numel)
    return MemoryNeed(_BASE_BYTES + 3 * 4 * largest.numel,
                      f"0.5 GB + 3 float32 copies of its largest tensor ({largest.name}, "
                      f"{4 * largest.numel / 1e6:,.0f} MB each)")
