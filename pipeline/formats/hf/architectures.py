"""HF -> GGUF tables: which architectures we package and how their tensors are named.

Data, not logic: `source.py` reads these tables and the inspect stage takes its list of
supported architectures from `HF_ARCHITECTURES`. Adding an architecture means adding an
`ArchSpec` row here, after checking what llama.cpp's converter and loader do for it
(convert_hf_to_gguf's model class, src/models/<arch>.cpp's `load_arch_tensors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import gguf

__all__ = [
    "ROPE_FREQS",
    "GENERATED_TENSORS",
    "ArchSpec",
    "ARCH_SPECS",
    "ARCHITECTURES",
    "HF_ARCHITECTURES",
    "SKIPPED_SUFFIXES",
    "REQUIRED_GLOBAL",
    "REQUIRED_PER_BLOCK",
    "TRY_SUFFIXES",
    "ROPE_PERMUTED",
    "TERNARY_LATENT_KINDS",
]

# GGUF tensors every architecture here needs. `output.weight` is absent on purpose: with
# tied embeddings llama.cpp reuses token_embd.
REQUIRED_GLOBAL: tuple[str, ...] = ("token_embd.weight", "output_norm.weight")
# Per-block tensors of the Llama family; an ArchSpec adds its own extras.
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


@dataclass(frozen=True)
class ArchSpec:
    """How one HF architecture becomes a GGUF architecture.

    ``name`` is the card's ``architecture`` (the HF model_type). ``extra_names`` maps HF
    name endings that gguf's TensorNameMap lacks to GGUF per-block base names.
    ``has_output_head`` False: llama.cpp's graph always multiplies by token_embd, so an
    untied ``lm_head`` cannot be represented. ``ternary_latent``: the checkpoint holds
    latent weights that the model ternarizes itself at run time (BitNet b1.58), so the
    packager applies that same quantization before decomposing. ``activations``: the
    config ``hidden_act`` values llama.cpp's graph for this architecture computes.
    """

    name: str
    gguf_arch: gguf.MODEL_ARCH
    hf_classes: tuple[str, ...]
    has_rope_permute: bool  # q/k rows reordered from HF's half-split rope to GGML's interleaved one
    required_per_block: tuple[str, ...] = REQUIRED_PER_BLOCK
    extra_names: Mapping[str, str] = field(default_factory=dict)
    has_output_head: bool = True
    ternary_latent: bool = False
    activations: tuple[str, ...] = ("silu",)

    @property
    def gguf_name(self) -> str:
        """The `general.architecture` value llama.cpp dispatches on."""
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]


# Llama and Mistral use GGML's interleaved ("normal") rope, so the converter permutes q/k
# rows; Qwen2, Qwen3 and BitNet run NEOX rope in llama.cpp (llama_model_rope_type), which is
# HF's rotate-half layout already, so their rows stay as they are.
ARCH_SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("llama", gguf.MODEL_ARCH.LLAMA, ("LlamaForCausalLM",), True),
    # llama.cpp converts dense Mistral through its Llama path (same GGUF architecture).
    ArchSpec("mistral", gguf.MODEL_ARCH.LLAMA, ("MistralForCausalLM",), True),
    # q/k/v biases are optional tensors of llama.cpp's qwen2 loader; TensorNameMap names them.
    ArchSpec("qwen2", gguf.MODEL_ARCH.QWEN2, ("Qwen2ForCausalLM",), False),
    ArchSpec(
        "qwen3",
        gguf.MODEL_ARCH.QWEN3,
        ("Qwen3ForCausalLM",),
        False,
        required_per_block=(*REQUIRED_PER_BLOCK, "attn_q_norm.weight", "attn_k_norm.weight"),
    ),
    ArchSpec(
        "bitnet",
        gguf.MODEL_ARCH.BITNET,
        ("BitnetForCausalLM", "BitNetForCausalLM"),
        False,
        required_per_block=(*REQUIRED_PER_BLOCK, "attn_sub_norm.weight", "ffn_sub_norm.weight"),
        # TensorNameMap knows 1bitLLM's inner_attn_ln / ffn_layernorm; transformers' BitNet
        # class names the same norms attn_sub_norm / ffn_sub_norm.
        extra_names={
            "self_attn.attn_sub_norm.weight": "attn_sub_norm",
            "mlp.ffn_sub_norm.weight": "ffn_sub_norm",
        },
        has_output_head=False,
        ternary_latent=True,
    ),
)

# HF class name -> spec: what the inspect stage accepts.
HF_ARCHITECTURES: dict[str, ArchSpec] = {cls: spec for spec in ARCH_SPECS for cls in spec.hf_classes}
# Keyed by the card's `architecture` (model_type) and also by the HF class name.
ARCHITECTURES: dict[str, ArchSpec] = {**{spec.name: spec for spec in ARCH_SPECS}, **HF_ARCHITECTURES}

# GGUF per-block kinds whose weights a `ternary_latent` architecture quantizes at run time
# (BitNet's BitLinear layers): llama.cpp's converter applies the same absmean rounding.
TERNARY_LATENT_KINDS: tuple[str, ...] = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)

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

# Tensors the package stage computes from config.json itself (not from weights, so not in
# decompose's parts): Llama 3.1+ rope scaling factors.
ROPE_FREQS = f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight"
GENERATED_TENSORS: tuple[str, ...] = (ROPE_FREQS,)
