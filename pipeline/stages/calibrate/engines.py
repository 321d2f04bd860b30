"""Which way calibrate runs the source, and the memory each way needs.

- ``llama``: llama.cpp runs the whole source (a GGUF source as stored; an HF checkpoint as a
  16-bit GGUF written for the run). It also answers validate's prompts, so validate can tell
  whether the source itself answers. Its memory grows with the model: 2 bytes a parameter.
- ``torch``: the checkpoint runs in torch one transformer block at a time
  (`calibration.torch_collect`), hidden states carried between blocks and each weight read once
  per block in its stored 16-bit type, so memory is one tensor (the largest: the embedding or a
  block weight) and the logits of one sequence: flat in the number of blocks. It makes the
  reference (and the statistics) only, not the answers.

``auto`` (the default) takes llama.cpp where its whole-model run needs no more memory than the
block-wise run would (small models, and models whose embedding dwarfs a block, such as Gemma 3
270M), and torch otherwise, where the architecture is one the torch forward computes; a GGUF
source always runs in llama.cpp. The choice depends on the model card only, so equal inputs
choose alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.formats.model_card import ModelCard

__all__ = ["ENGINES", "EngineChoice", "choose_engine", "llama_need_bytes", "torch_need_bytes"]

ENGINES = ("auto", "llama", "torch")
_MARGIN_BYTES = 512 << 20
# Python, torch and llama.cpp's context besides the weights.
_TORCH_BASE_BYTES = 768 << 20


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "llama" or "torch"
    need_bytes: int
    why: str


def llama_need_bytes(card: ModelCard, download_bytes: int) -> int:
    """llama.cpp's whole-model run: the source as stored (GGUF) or a 16-bit copy, plus a margin."""
    held = download_bytes if card.is_gguf else 2 * card.param_count
    return held + _MARGIN_BYTES


def torch_need_bytes(card: ModelCard, sequence_tokens: int) -> int:
    """The block-wise run: one tensor at a time in its 16-bit type (read, then copied), the largest
    being the embedding or a block weight, and one sequence's float32 logits over the vocabulary."""
    largest = max((tensor.numel for tensor in card.tensors), default=0)
    return _TORCH_BASE_BYTES + 2 * 2 * largest + 4 * card.embedding_rows * sequence_tokens


def choose_engine(card: ModelCard, requested: str, download_bytes: int, sequence_tokens: int) -> EngineChoice:
    """The engine for ``requested`` (one of `ENGINES`); ``auto`` as the module docstring says.
    ``sequence_tokens``: the longest sequence the source runs over (its logits are held at once)."""
    llama_need = llama_need_bytes(card, download_bytes)
    if requested == "llama" or card.is_gguf:
        held = (f"as stored ({download_bytes / 1e9:.2f} GB)" if card.is_gguf else
                f"as a 16-bit copy ({card.param_count / 1e9:.2f}B parameters x 2 bytes)")
        return EngineChoice("llama", llama_need, f"llama.cpp runs the whole source {held}")
    torch_need = torch_need_bytes(card, sequence_tokens)
    if requested == "auto" and llama_need <= torch_need:  # decided without loading torch
        return EngineChoice("llama", llama_need, "llama.cpp runs the whole source: it needs "
                            f"{llama_need / 1e9:.2f} GB, no more than the block-wise run's "
                            f"{torch_need / 1e9:.2f} GB")
    why_not = _torch_refusal(card)
    if requested == "torch":
        if why_not:
            from pipeline.core.errors import InputError

            raise InputError(f"reference_engine=torch: {why_not}; use reference_engine=llama or auto")
        return EngineChoice("torch", torch_need, "asked for: the source runs one block at a time in torch")
    if why_not:
        return EngineChoice("llama", llama_need, f"llama.cpp runs the whole source: {why_not}")
    return EngineChoice("torch", torch_need, f"one block at a time in torch: {torch_need / 1e9:.2f} GB "
                        f"instead of llama.cpp's {llama_need / 1e9:.2f} GB for the whole source")


def _torch_refusal(card: ModelCard) -> str:
    """Why the torch forward cannot run this checkpoint, or ""."""
    from pipeline.calibration.torch_model import model_spec
    from pipeline.core.errors import InputError

    try:
        model_spec(card)
    except InputError as exc:
        return str(exc)
    return ""
