"""HF -> GGUF tables: which architectures we package and how their tensors are named.

Data, not logic: `source.py` reads these tables. Adding an architecture means adding a
row here (and checking that llama.cpp's converter does nothing else special for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

__all__ = [
    "ROPE_FREQS",
    "GENERATED_TENSORS",
    "ArchSpec",
    "ARCHITECTURES",
    "SKIPPED_SUFFIXES",
    "REQUIRED_GLOBAL",
    "REQUIRED_PER_BLOCK",
    "TRY_SUFFIXES",
    "ROPE_PERMUTED",
]


@dataclass(frozen=True)
class ArchSpec:
    """How one HF architecture becomes a GGUF architecture."""

    gguf_arch: gguf.MODEL_ARCH
    gguf_name: str  # the `general.architecture` value llama.cpp dispatches on
    has_rope_permute: bool  # q/k rows reordered from HF's half-split rope to GGML's interleaved one


# Keyed by the card's `architecture` (model_type) and also by the HF class name.
_LLAMA = ArchSpec(gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA], True)
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "LlamaForCausalLM": _LLAMA,
    "mistral": _LLAMA,  # llama.cpp converts Mistral (dense) through its Llama path
    "MistralForCausalLM": _LLAMA,
}

# Tensors present in some checkpoints that carry nothing llama.cpp needs.
# `rotary_emb.inv_freq` is a buffer recomputed from rope_theta at load time; old
# transformers versions saved it into checkpoints.
SKIPPED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)

# gguf's TensorNameMap holds base names; HF names end with these.
TRY_SUFFIXES: tuple[str, ...] = (".weight", ".bias")

# HF name endings whose rows the Llama converter permutes, with the config key giving
# the head count to permute by (k_proj uses the KV head count under GQA).
ROPE_PERMUTED: dict[str, str] = {
    "self_attn.q_proj.weight": "num_attention_heads",
    "self_attn.q_proj.bias": "num_attention_heads",
    "self_attn.k_proj.weight": "num_key_value_heads",
    "self_attn.k_proj.bias": "num_key_value_heads",
}

# GGUF tensors llama.cpp's Llama loader cannot do without. `output.weight` is absent
# on purpose: with tied embeddings llama.cpp reuses token_embd.
REQUIRED_GLOBAL: tuple[str, ...] = ("token_embd.weight", "output_norm.weight")
REQUIRED_PER_BLOCK: tuple[str, ...] = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)

# Tensors the package stage computes from config.json itself (not from weights, so not in
# decompose's parts): Llama 3.1+ rope scaling factors.
ROPE_FREQS = f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight"
GENERATED_TENSORS: tuple[str, ...] = (ROPE_FREQS,)
