"""A plain-torch forward pass of the demo architectures, written from the HF modelling code's maths.

Independent of pipeline code on purpose: it reads the HF checkpoint as saved (HF tensor
names, HF rotate-half rope, BitNet's run-time weight rounding done here) so a packaging
mistake (a missed or wrong permutation, a dropped bias or norm) shows as a logit difference
against llama.cpp. ``ablate`` leaves one feature out, to show that a test would notice.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["reference_logits", "ABLATIONS"]

# What `ablate` can leave out: q/k/v biases, q/k norms, BitNet sub-norms, BitNet weight
# rounding, or (for Llama) rope applied to adjacent pairs instead of HF's half-split layout.
ABLATIONS = ("bias", "qk_norm", "sub_norm", "weight_quant", "rope_layout")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _bitnet_quant(w: torch.Tensor) -> torch.Tensor:
    # BitNet b1.58 BitLinear: absmean scale per tensor, weights rounded to {-1, 0, +1} x scale.
    scale = w.abs().mean().clamp(min=1e-5)
    return (w / scale).round().clamp(-1, 1) * scale


def _weights(checkpoint: Path, config: dict, ablate: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    w = {k: v.float() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    if config["model_type"] == "bitnet" and ablate != "weight_quant":
        w = {k: _bitnet_quant(v) if any(f".{n}." in k for n in _LINEARS) else v for k, v in w.items()}
    return w


def reference_logits(checkpoint: Path, ids: list[int], ablate: str | None = None) -> np.ndarray:
    """Logits [len(ids), vocab] of the demo checkpoint at `checkpoint` (llama, mistral, qwen2/3, bitnet)."""
    config = json.loads((checkpoint / "config.json").read_text())
    w = _weights(checkpoint, config, ablate)
    n_head, n_kv, eps = config["num_attention_heads"], config["num_key_value_heads"], config["rms_norm_eps"]
    hd = config.get("head_dim") or config["hidden_size"] // n_head
    n = len(ids)
    pos = torch.arange(n, dtype=torch.float32)
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(pos, inv_freq)[:, None, :]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x: torch.Tensor) -> torch.Tensor:
        if ablate == "rope_layout":  # adjacent pairs: what llama.cpp would do to unpermuted rows
            a, b = x[..., 0::2], x[..., 1::2]
            cos, sin = angles.cos(), angles.sin()
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        full = torch.cat([angles, angles], dim=-1)
        rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
        return x * full.cos() + rotated * full.sin()

    def linear(h: torch.Tensor, name: str) -> torch.Tensor:
        out = h @ w[name + ".weight"].T
        bias = w.get(name + ".bias")
        return out + bias if bias is not None and ablate != "bias" else out

    x = w["model.embed_tokens.weight"][ids]
    mask = torch.full((n, n), float("-inf")).triu(1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = linear(h, p + "self_attn.q_proj").view(n, n_head, hd)
        k = linear(h, p + "self_attn.k_proj").view(n, n_kv, hd)
        v = linear(h, p + "self_attn.v_proj").view(n, n_kv, hd)
        if p + "self_attn.q_norm.weight" in w and ablate != "qk_norm":
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(n_head // n_kv, dim=1) for t in (k, v))
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd**0.5 + mask, dim=-1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1)
        if p + "self_attn.inner_attn_ln.weight" in w and ablate != "sub_norm":
            out = norm(out, w[p + "self_attn.inner_attn_ln.weight"])
        x = x + linear(out, p + "self_attn.o_proj")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(linear(h, p + "mlp.gate_proj")) * linear(h, p + "mlp.up_proj")
        if p + "mlp.ffn_layernorm.weight" in w and ablate != "sub_norm":
            act = norm(act, w[p + "mlp.ffn_layernorm.weight"])
        x = x + linear(act, p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return (norm(x, w["model.norm.weight"]) @ head.T).numpy()
