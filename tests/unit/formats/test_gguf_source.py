"""Tensor plan (HF -> GGUF names, no data) and streaming with the Llama rope permutation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from pipeline.core.errors import InputError
from pipeline.formats.hf.checkpoint import PlannedTensor, iter_tensors, rope_permute, tensor_plan
from pipeline.formats.model_card import ModelCard


def _reference_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Row-by-row statement of the rope reordering: per head, row pairs (j, j + d/2) interleave."""
    head_dim = weight.shape[0] // n_head
    half = head_dim // 2
    out = torch.empty_like(weight)
    for head in range(n_head):
        for j in range(half):
            for k in range(2):
                out[head * head_dim + 2 * j + k] = weight[head * head_dim + k * half + j]
    return out


def test_plan_names_every_tensor(demo_card: dict[str, Any]) -> None:
    plan = tensor_plan(ModelCard.from_dict(demo_card))
    by_name = {p.gguf_name: p for p in plan}
    assert len(plan) == len(demo_card["tensors"])
    assert by_name["token_embd.weight"].hf_name == "model.embed_tokens.weight"
    assert by_name["output.weight"].hf_name == "lm_head.weight"
    assert by_name["blk.1.attn_k.weight"] == PlannedTensor(
        "blk.1.attn_k.weight",
        "model.layers.1.self_attn.k_proj.weight",
        (128, 256),
        "BF16",
        "model.safetensors",
    )
    assert by_name["blk.0.ffn_down.weight"].shape == (256, 512)
    assert {"output_norm.weight", "blk.0.attn_norm.weight", "blk.1.ffn_norm.weight"} <= set(by_name)


def test_unmapped_tensor_is_named(demo_card: dict[str, Any]) -> None:
    card = copy.deepcopy(demo_card)
    card["tensors"].append(
        {"name": "model.layers.0.mystery.weight", "shape": [4], "dtype": "BF16", "shard": "model.safetensors"}
    )
    with pytest.raises(InputError, match=r"model\.layers\.0\.mystery\.weight"):
        tensor_plan(ModelCard.from_dict(card))


def test_inv_freq_is_skipped(demo_card: dict[str, Any]) -> None:
    card = copy.deepcopy(demo_card)
    card["tensors"].append(
        {
            "name": "model.layers.0.self_attn.rotary_emb.inv_freq",
            "shape": [32],
            "dtype": "F32",
            "shard": "model.safetensors",
        }
    )
    assert len(tensor_plan(ModelCard.from_dict(card))) == len(demo_card["tensors"])


def test_missing_layer_tensor_is_refused(demo_card: dict[str, Any]) -> None:
    card = copy.deepcopy(demo_card)
    card["tensors"] = [t for t in card["tensors"] if t["name"] != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InputError, match=r"blk\.1\.ffn_up\.weight"):
        tensor_plan(ModelCard.from_dict(card))


def test_unknown_architecture_is_refused(demo_card: dict[str, Any]) -> None:
    card = {**demo_card, "architecture": "gpt_neox", "hf_architecture": "GPTNeoXForCausalLM"}
    with pytest.raises(InputError, match="GPTNeoXForCausalLM"):
        tensor_plan(ModelCard.from_dict(card))


def test_rope_permute_matches_reference() -> None:
    weight = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    assert torch.equal(rope_permute(weight, 2), _reference_permute(weight, 2))
    assert torch.equal(rope_permute(weight, 4), _reference_permute(weight, 4))


def test_iter_tensors_permutes_q_and_k_only(demo_checkpoint: Path, demo_card: dict[str, Any]) -> None:
    files = {"model.safetensors": demo_checkpoint / "model.safetensors"}
    config = demo_card["config"]
    plan = {p.gguf_name: p for p in tensor_plan(ModelCard.from_dict(demo_card))}
    seen = []
    with safe_open(str(files["model.safetensors"]), framework="pt") as handle:
        for gguf_name, tensor in iter_tensors(ModelCard.from_dict(demo_card), files, "model.safetensors"):
            seen.append(gguf_name)
            assert tensor.dtype == torch.float32 and tensor.is_contiguous()
            original = handle.get_tensor(plan[gguf_name].hf_name).float()
            if gguf_name.endswith("attn_q.weight"):
                expected = _reference_permute(original, config["num_attention_heads"])
            elif gguf_name.endswith("attn_k.weight"):
                expected = _reference_permute(original, config["num_key_value_heads"])
            else:
                expected = original
            assert torch.equal(tensor, expected), gguf_name
    assert seen == list(plan)


def test_iter_tensors_unknown_shard(demo_checkpoint: Path, demo_card: dict[str, Any]) -> None:
    with pytest.raises(InputError, match="nope.safetensors"):
        next(iter_tensors(ModelCard.from_dict(demo_card), {}, "nope.safetensors"))
