"""A tiny, deterministic Llama checkpoint for tests and demos.

`write_demo_checkpoint` writes what a Hugging Face snapshot of a small Llama model
looks like: ``config.json``, ``model.safetensors`` (BF16, HF tensor names),
``tokenizer.json`` + ``tokenizer_config.json`` (byte-level BPE) and ``SHA256SUMS``.

Every linear weight is *exactly* ``scale * t`` with ``t`` in {-1, 0, +1} for each
256-wide block of each row, and every scale is exact in both BF16 and FP16, so a
ternary conversion of it is lossless: tests can demand bit-exact round trips.

Example::

    from pipeline.demo import write_demo_checkpoint
    folder = write_demo_checkpoint(tmp_path / "demo")
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

__all__ = ["write_demo_checkpoint", "DEMO_BLOCK_SIZE", "DEMO_BOS", "DEMO_EOS", "DEMO_FILES"]

DEMO_BLOCK_SIZE = 256  # ternary GGUF types (TQ1_0, TQ2_0) work on 256-wide row blocks
DEMO_BOS = "<|begin_of_text|>"
DEMO_EOS = "<|end_of_text|>"
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_VOCAB_SIZE_TARGET = 512
# Scales are m * 2**-e with small odd m: exact in BF16 (8 significant bits) and in
# FP16 (11 bits, normal down to 2**-14), so scale * trit survives both casts.
_SCALE_MANTISSAS = (1, 3, 5, 7)
_SCALE_EXPONENTS = (6, 7, 8)

_TEXT_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns to add numbers one step at a time.",
    "Bonsai trees are small, but they are still trees.",
    "Ternary weights take the values minus one, zero and plus one.",
    "Café, naïve, résumé and jalapeño keep their accents.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 65536.",
    "    indented line with  double  spaces and\ttabs.",
    "What is 1+1? The answer is 2.",
    "Every layer holds attention, a gated feed forward block and two norms.",
    "Weights are packed into blocks of two hundred and fifty six values.",
    "Checksums prove that the files are the files that were published.",
    "Emoji 🙂 and symbols like €, ©, → are bytes too.",
)


def _training_text() -> list[str]:
    """Built-in corpus: prose plus every 'a+b=c' line for small a, b (so '1+1=2' exists)."""
    lines = list(_TEXT_LINES)
    for a in range(10):
        for b in range(10):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a}*{b}={a * b} and {a}-{b}={a - b}")
    return lines


def _train_tokenizer() -> object:
    """Byte-level BPE (GPT-2 style pre-tokenizer) with BOS/EOS as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE_TARGET,
        min_frequency=1,
        special_tokens=[DEMO_BOS, DEMO_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tokenizer.token_to_id(DEMO_BOS)
    # Like Llama 3: the post-processor adds BOS, tokenizer_config says so too.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{DEMO_BOS} $A",
        pair=f"{DEMO_BOS} $A {DEMO_BOS} $B",
        special_tokens=[(DEMO_BOS, bos_id)],
    )
    return tokenizer


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


def _model_tensors(
    n_layers: int, hidden: int, intermediate: int, n_heads: int, n_kv_heads: int, vocab: int, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // n_heads
    kv_dim = head_dim * n_kv_heads
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _dense((vocab, hidden), 0.02, gen)}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (kv_dim, hidden),
            "self_attn.v_proj": (kv_dim, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (intermediate, hidden),
            "mlp.up_proj": (intermediate, hidden),
            "mlp.down_proj": (hidden, intermediate),
        }
        for name, (rows, cols) in shapes.items():
            tensors[f"{p}.{name}.weight"] = _ternary_weight(rows, cols, gen)
        # Norm weights near 1, not exactly 1, so a dropped or swapped norm shows up in tests.
        tensors[f"{p}.input_layernorm.weight"] = (1.0 + _dense((hidden,), 0.05, gen).float()).bfloat16()
        tensors[f"{p}.post_attention_layernorm.weight"] = (
            1.0 + _dense((hidden,), 0.05, gen).float()
        ).bfloat16()
    tensors["model.norm.weight"] = (1.0 + _dense((hidden,), 0.05, gen).float()).bfloat16()
    tensors["lm_head.weight"] = _dense((vocab, hidden), 0.02, gen)
    return tensors


def _config(
    n_layers: int,
    hidden: int,
    intermediate: int,
    n_heads: int,
    n_kv_heads: int,
    vocab: int,
    bos_id: int,
    eos_id: int,
) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": hidden // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_checkpoint(
    dest: Path,
    n_layers: int = 2,
    hidden: int = 256,
    intermediate: int = 512,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Write a tiny Llama HF checkpoint into `dest` (created if needed) and return `dest`.

    Same arguments give the same bytes. `hidden` and `intermediate` must be multiples
    of 256 (ValueError otherwise) because the linear weights are ternary per 256-block.
    """
    if hidden % DEMO_BLOCK_SIZE or intermediate % DEMO_BLOCK_SIZE:
        raise ValueError(f"hidden={hidden} and intermediate={intermediate} must be multiples of 256")
    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError(f"hidden={hidden}, n_heads={n_heads}, n_kv_heads={n_kv_heads} do not divide")
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    vocab = tokenizer.get_vocab_size()  # type: ignore[attr-defined]
    bos_id = tokenizer.token_to_id(DEMO_BOS)  # type: ignore[attr-defined]
    eos_id = tokenizer.token_to_id(DEMO_EOS)  # type: ignore[attr-defined]

    tensors = _model_tensors(n_layers, hidden, intermediate, n_heads, n_kv_heads, vocab, seed)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        dest / "config.json",
        _config(n_layers, hidden, intermediate, n_heads, n_kv_heads, vocab, bos_id, eos_id),
    )
    tokenizer.save(str(dest / "tokenizer.json"))  # type: ignore[attr-defined]
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
    sums = []
    for name in DEMO_FILES:
        with open(dest / name, "rb") as handle:
            sums.append(f"{hashlib.file_digest(handle, 'sha256').hexdigest()}  {name}\n")
    (dest / "SHA256SUMS").write_text("".join(sums), encoding="utf-8")
    return dest
