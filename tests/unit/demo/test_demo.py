"""The demo checkpoint: deterministic, Llama-shaped, and exactly ternary per 256-block."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from pipeline.demo.checkpoint import DEMO_FILES, write_demo_checkpoint

_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_same_seed_gives_same_bytes(tmp_path: Path, demo_checkpoint: Path) -> None:
    again = write_demo_checkpoint(tmp_path / "again")
    for name in (*DEMO_FILES, "SHA256SUMS"):
        assert (again / name).read_bytes() == (demo_checkpoint / name).read_bytes(), name


def test_other_seed_changes_weights_only(tmp_path: Path, demo_checkpoint: Path) -> None:
    other = write_demo_checkpoint(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (demo_checkpoint / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (demo_checkpoint / "tokenizer.json").read_bytes()


def test_sha256sums_lists_every_file(demo_checkpoint: Path) -> None:
    lines = (demo_checkpoint / "SHA256SUMS").read_text().splitlines()
    listed = dict(reversed(line.split("  ", 1)) for line in lines)
    assert sorted(listed) == sorted(DEMO_FILES)
    for name, digest in listed.items():
        assert hashlib.sha256((demo_checkpoint / name).read_bytes()).hexdigest() == digest


def test_config_and_tensor_shapes_agree(demo_checkpoint: Path) -> None:
    config = json.loads((demo_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False
    with safe_open(str(demo_checkpoint / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_slice("model.embed_tokens.weight").get_shape() == [config["vocab_size"], 256]
        assert handle.get_slice("model.layers.1.self_attn.k_proj.weight").get_shape() == [128, 256]
        assert handle.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [256, 512]
        assert handle.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert len(names) == 2 + 1 + config["num_hidden_layers"] * 9


def test_linear_weights_are_exact_scaled_ternary(demo_checkpoint: Path) -> None:
    with safe_open(str(demo_checkpoint / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            if not any(part in name for part in _LINEAR):
                continue
            weight = handle.get_tensor(name).float()
            blocks = weight.reshape(weight.shape[0], -1, 256)
            scale = blocks.abs().amax(dim=-1, keepdim=True)
            trits = blocks / scale
            assert torch.equal(trits, trits.round()), name
            assert torch.equal(scale.half().float(), scale), f"{name}: scale not fp16-exact"
            zero_fraction = (trits == 0).float().mean().item()
            assert 0.25 < zero_fraction < 0.42, f"{name}: {zero_fraction:.2f} zeros"


def test_tokenizer_has_specials_and_digits(demo_checkpoint: Path) -> None:
    tokenizer = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    config = json.loads((demo_checkpoint / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"] == 512
    encoded = tokenizer.encode("1+1=2")
    assert encoded.ids[0] == config["bos_token_id"]
    assert tokenizer.decode(encoded.ids, skip_special_tokens=True) == "1+1=2"


def test_other_architectures_are_deterministic(tmp_path: Path) -> None:
    for arch in ("mistral", "qwen2", "qwen3", "bitnet"):
        first = write_demo_checkpoint(tmp_path / f"{arch}-1", architecture=arch)
        second = write_demo_checkpoint(tmp_path / f"{arch}-2", architecture=arch)
        assert (first / "SHA256SUMS").read_text() == (second / "SHA256SUMS").read_text(), arch
        config = json.loads((first / "config.json").read_text())
        assert config["model_type"] == arch and len(config["architectures"]) == 1
        listed = [line.split("  ", 1)[1] for line in (first / "SHA256SUMS").read_text().splitlines()]
        assert ("tokenizer.model" in listed) == (arch in ("mistral", "bitnet")), arch
