"""Tiny, deterministic HF checkpoints (Llama, Mistral, Qwen2, Qwen3, BitNet) for tests and demos.

`write_demo_checkpoint` writes what a Hugging Face snapshot of a small model looks like:
``config.json``, ``model.safetensors`` (BF16, HF tensor names), the tokenizer files
(``tokenizer.json`` byte-level BPE, or a SentencePiece ``tokenizer.model``; see
`pipeline.demo.tokenizers`), ``tokenizer_config.json`` and ``SHA256SUMS``.

Every linear weight is *exactly* ``scale * t`` with ``t`` in {-1, 0, +1} for each
256-wide block of each row, and every scale is exact in both BF16 and FP16, so a
ternary conversion of it is lossless: tests can demand bit-exact round trips. BitNet is
the exception on purpose: its checkpoints hold dense latent weights that the model
itself rounds to ternary at run time.

Per architecture (`ARCHITECTURE_DEFAULTS`): Mistral gets a SentencePiece tokenizer; Qwen2
q/k/v biases, tied embeddings and a Qwen2 BPE; Qwen3 q/k norms and head_dim = 2 x
hidden / heads; BitNet sub-norms, tied embeddings and a SentencePiece tokenizer.

Example::

    from pipeline.demo.checkpoint import write_demo_checkpoint
    folder = write_demo_checkpoint(tmp_path / "demo")
    qwen = write_demo_checkpoint(tmp_path / "qwen", architecture="qwen2")
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "write_demo_checkpoint",
    "ARCHITECTURE_DEFAULTS",
    "DEMO_BLOCK_SIZE",
    "DEMO_BOS",
    "DEMO_EOS",
    "DEMO_FILES",
]

DEMO_BLOCK_SIZE = 256  # ternary GGUF types (TQ1_0, TQ2_0) work on 256-wide row blocks
DEMO_BOS = "<|begin_of_text|>"
DEMO_EOS = "<|end_of_text|>"
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class _ArchDefaults:
    """How one demo architecture differs from the Llama one."""

    hf_class: str
    model_type: str
    tokenizer: str  # a pipeline.demo.tokenizers kind
    is_tied: bool = False
    has_qkv_bias: bool = False
    has_qk_norm: bool = False
    has_sub_norms: bool = False
    has_latent_weights: bool = False
    head_dim_factor: int = 1  # head_dim = factor * hidden / heads
    config: tuple[tuple[str, Any], ...] = ()


ARCHITECTURE_DEFAULTS: dict[str, _ArchDefaults] = {
    "llama": _ArchDefaults("LlamaForCausalLM", "llama", "gpt2"),
    "mistral": _ArchDefaults(
        "MistralForCausalLM", "mistral", "spm", config=(("rope_theta", 1000000.0), ("sliding_window", None))
    ),
    "qwen2": _ArchDefaults(
        "Qwen2ForCausalLM",
        "qwen2",
        "qwen2",
        is_tied=True,
        has_qkv_bias=True,
        config=(
            ("rope_theta", 1000000.0),
            ("rms_norm_eps", 1e-6),
            ("use_sliding_window", False),
            ("sliding_window", 4096),
            ("max_window_layers", 2),
        ),
    ),
    # Qwen3 decouples head_dim from hidden / heads (Qwen3-0.6B: 1024 hidden, 16 heads of 128).
    "qwen3": _ArchDefaults(
        "Qwen3ForCausalLM",
        "qwen3",
        "qwen2",
        has_qk_norm=True,
        head_dim_factor=2,
        config=(("rope_theta", 1000000.0), ("rms_norm_eps", 1e-6), ("use_sliding_window", False)),
    ),
    # 1bitLLM's layout: sub-norms before o_proj and down_proj; llama.cpp's bitnet graph reads
    # the output head from token_embd, so the demo ties it.
    "bitnet": _ArchDefaults(
        "BitnetForCausalLM", "bitnet", "spm", is_tied=True, has_sub_norms=True, has_latent_weights=True
    ),
}

# Scales are m * 2**-e with small odd m: exact in BF16 (8 significant bits) and in
# FP16 (11 bits, normal down to 2**-14), so scale * trit survives both casts.
_SCALE_MANTISSAS = (1, 3, 5, 7)
_SCALE_EXPONENTS = (6, 7, 8)


def _train_tokenizer() -> Any:
    """The Llama demo's byte-level BPE (GPT-2 pre-tokenizer) with BOS/EOS as special tokens."""
    from pipeline.demo.tokenizers import train_gpt2

    return train_gpt2(DEMO_BOS, DEMO_EOS)


def _ternary_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """BF16 [rows, cols] that is exactly scale * {-1,0,+1} per 256-wide row block."""
    if cols % DEMO_BLOCK_SIZE:
        raise ValueError(f"cols={cols} is not a multiple of {DEMO_BLOCK_SIZE}")
    n_blocks = cols // DEMO_BLOCK_SIZE
    trits = torch.randint(-1, 2, (rows, cols), generator=gen, dtype=torch.int8).to(torch.float32)
    mant = torch.tensor(_SCALE_MANTISSAS, dtype=torch.float32)
    expo = torch.tensor(_SCALE_EXPONENTS, dtype=torch.float32)
    m_idx = torch.randint(0, len(_SCALE_MANTISSAS), (rows, n_blocks), generator=gen)
    e_idx = torch.randint(0, len(_SCALE_EXPONENTS), (rows, n_blocks), generator=gen)
    scales = mant[m_idx] * torch.pow(2.0, -expo[e_idx])
    weight = trits * scales.repeat_interleave(DEMO_BLOCK_SIZE, dim=1)
    return weight.to(torch.bfloat16)


def _dense(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def _latent_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """BF16 dense latent weights, as BitNet checkpoints store them (the model ternarizes at run time)."""
    return _dense((rows, cols), 0.02, gen)


def _near_one(size: int, gen: torch.Generator) -> torch.Tensor:
    # Norm weights near 1, not exactly 1, so a dropped or swapped norm shows up in tests.
    return (1.0 + _dense((size,), 0.05, gen).float()).bfloat16()


def _arch_extras(
    arch: _ArchDefaults, prefix: str, dims: tuple[int, int, int, int], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Per-layer tensors only some architectures have (drawn after the Llama ones)."""
    q_dim, kv_dim, head_dim, intermediate = dims
    out: dict[str, torch.Tensor] = {}
    if arch.has_qkv_bias:
        for name, size in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            out[f"{prefix}.self_attn.{name}.bias"] = _dense((size,), 0.1, gen)
    if arch.has_qk_norm:
        out[f"{prefix}.self_attn.q_norm.weight"] = _near_one(head_dim, gen)
        out[f"{prefix}.self_attn.k_norm.weight"] = _near_one(head_dim, gen)
    if arch.has_sub_norms:
        out[f"{prefix}.self_attn.inner_attn_ln.weight"] = _near_one(q_dim, gen)
        out[f"{prefix}.mlp.ffn_layernorm.weight"] = _near_one(intermediate, gen)
    return out


def _model_tensors(
    arch: _ArchDefaults,
    n_layers: int,
    hidden: int,
    intermediate: int,
    heads: tuple[int, int, int],
    vocab: int,
    seed: int,
    weights: str = "ternary",
) -> dict[str, torch.Tensor]:
    n_heads, n_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    q_dim, kv_dim = head_dim * n_heads, head_dim * n_kv_heads
    linear = _latent_weight if arch.has_latent_weights or weights == "dense" else _ternary_weight
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _dense((vocab, hidden), 0.02, gen)}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (q_dim, hidden),
            "self_attn.k_proj": (kv_dim, hidden),
            "self_attn.v_proj": (kv_dim, hidden),
            "self_attn.o_proj": (hidden, q_dim),
            "mlp.gate_proj": (intermediate, hidden),
            "mlp.up_proj": (intermediate, hidden),
            "mlp.down_proj": (hidden, intermediate),
        }
        for name, (rows, cols) in shapes.items():
            tensors[f"{p}.{name}.weight"] = linear(rows, cols, gen)
        tensors[f"{p}.input_layernorm.weight"] = _near_one(hidden, gen)
        tensors[f"{p}.post_attention_layernorm.weight"] = _near_one(hidden, gen)
        tensors.update(_arch_extras(arch, p, (q_dim, kv_dim, head_dim, intermediate), gen))
    tensors["model.norm.weight"] = _near_one(hidden, gen)
    if not arch.is_tied:
        tensors["lm_head.weight"] = _dense((vocab, hidden), 0.02, gen)
    return tensors


def _config(
    arch: _ArchDefaults,
    n_layers: int,
    hidden: int,
    intermediate: int,
    heads: tuple[int, int, int],
    vocab: int,
    special_ids: tuple[int | None, int | None],
) -> dict[str, object]:
    n_heads, n_kv_heads, head_dim = heads
    config: dict[str, object] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": arch.has_qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": arch.is_tied,
        "vocab_size": vocab,
        "bos_token_id": special_ids[0],
        "eos_token_id": special_ids[1],
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    config.update(dict(arch.config))
    return config


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_gpt2_tokenizer(dest: Path) -> tuple[list[str], int, tuple[int | None, int | None]]:
    """The Llama demo's tokenizer files; returns (file names, vocab size, (bos id, eos id))."""
    tokenizer = _train_tokenizer()
    tokenizer.save(str(dest / "tokenizer.json"))
    _write_json(
        dest / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": DEMO_BOS,
            "eos_token": DEMO_EOS,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": 256,
            "clean_up_tokenization_spaces": False,
        },
    )
    ids = (tokenizer.token_to_id(DEMO_BOS), tokenizer.token_to_id(DEMO_EOS))
    return ["tokenizer.json", "tokenizer_config.json"], tokenizer.get_vocab_size(), ids


def _write_tokenizer(kind: str, dest: Path) -> tuple[list[str], int, tuple[int | None, int | None]]:
    if kind == "gpt2":
        return _write_gpt2_tokenizer(dest)
    from pipeline.demo.tokenizers import write_tokenizer

    trained = write_tokenizer(kind, dest)
    return sorted(trained.files), trained.vocab_size, (trained.bos_id, trained.eos_id)


def _check_dims(hidden: int, intermediate: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    if hidden % DEMO_BLOCK_SIZE or intermediate % DEMO_BLOCK_SIZE or (head_dim * n_heads) % DEMO_BLOCK_SIZE:
        raise ValueError(
            f"hidden={hidden}, intermediate={intermediate} and heads x head_dim={n_heads * head_dim} "
            "must be multiples of 256"
        )
    if hidden % n_heads or n_heads % n_kv_heads or head_dim % 2:
        raise ValueError(f"hidden={hidden}, n_heads={n_heads}, n_kv_heads={n_kv_heads} do not divide")


def write_demo_checkpoint(
    dest: Path,
    n_layers: int = 2,
    hidden: int = 256,
    intermediate: int = 512,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    seed: int = 0,
    architecture: str = "llama",
    tokenizer: str | None = None,
    weights: str = "ternary",
) -> Path:
    """Write a tiny HF checkpoint of `architecture` into `dest` (created if needed) and return `dest`.

    `architecture` is a key of `ARCHITECTURE_DEFAULTS`; `tokenizer` overrides its tokenizer kind
    ("gpt2", "llama-bpe", "qwen2", "spm"). Same arguments give the same bytes. `hidden`,
    `intermediate` and heads x head_dim must be multiples of 256 (ValueError otherwise)
    because the linear weights are ternary per 256-block. ``weights="dense"`` draws ordinary
    (Gaussian) linear weights instead: a checkpoint whose ternary conversion is lossy.
    """
    if weights not in ("ternary", "dense"):
        raise ValueError(f"weights {weights!r}; expected 'ternary' or 'dense'")
    if architecture not in ARCHITECTURE_DEFAULTS:
        raise ValueError(f"architecture {architecture!r}; expected one of {', '.join(ARCHITECTURE_DEFAULTS)}")
    arch = ARCHITECTURE_DEFAULTS[architecture]
    head_dim = arch.head_dim_factor * (hidden // n_heads)
    _check_dims(hidden, intermediate, n_heads, n_kv_heads, head_dim)
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names, vocab, special_ids = _write_tokenizer(tokenizer or arch.tokenizer, dest)
    heads = (n_heads, n_kv_heads, head_dim)
    tensors = _model_tensors(arch, n_layers, hidden, intermediate, heads, vocab, seed, weights)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        dest / "config.json", _config(arch, n_layers, hidden, intermediate, heads, vocab, special_ids)
    )
    sums = []
    for name in ("config.json", "model.safetensors", *names):
        with open(dest / name, "rb") as handle:
            sums.append(f"{hashlib.file_digest(handle, 'sha256').hexdigest()}  {name}\n")
    (dest / "SHA256SUMS").write_text("".join(sums), encoding="utf-8")
    return dest
