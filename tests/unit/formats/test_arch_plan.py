"""Per-architecture tensor plans and source rules (no llama.cpp): names, permutation, BitNet, refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import card_for_checkpoint
from safetensors import safe_open

from pipeline.core.errors import InputError
from pipeline.demo.checkpoint import write_demo_checkpoint
from pipeline.formats.hf.architectures import ARCH_SPECS, HF_ARCHITECTURES
from pipeline.formats.hf.checkpoint import bitnet_weight_quant, iter_tensors, tensor_plan
from pipeline.formats.model_card import ModelCard
from pipeline.stages.inspect.stage import SUPPORTED_ARCHITECTURES
from pipeline.ternary.policy import decide, get_recipe


@pytest.fixture(scope="module")
def cards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    out = {}
    for spec in ARCH_SPECS:
        folder = write_demo_checkpoint(tmp_path_factory.mktemp(spec.name), architecture=spec.name)
        out[spec.name] = (folder, card_for_checkpoint(folder))
    return out


def test_inspect_and_packaging_share_one_table() -> None:
    assert SUPPORTED_ARCHITECTURES == {cls: spec.name for cls, spec in HF_ARCHITECTURES.items()}
    assert {"BitnetForCausalLM", "BitNetForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(
        SUPPORTED_ARCHITECTURES
    )


def test_new_tensors_are_named_and_kept_in_f32(cards: dict[str, Any]) -> None:
    recipe = get_recipe("tq2_0")
    expected = {
        "qwen2": {"model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias"},
        "qwen3": {"model.layers.1.self_attn.k_norm.weight": "blk.1.attn_k_norm.weight"},
        "bitnet": {
            "model.layers.0.self_attn.inner_attn_ln.weight": "blk.0.attn_sub_norm.weight",
            "model.layers.1.mlp.ffn_layernorm.weight": "blk.1.ffn_sub_norm.weight",
        },
    }
    for arch, names in expected.items():
        plan = {p.hf_name: p for p in tensor_plan(ModelCard.from_dict(cards[arch][1]))}
        for hf_name, gguf_name in names.items():
            assert plan[hf_name].gguf_name == gguf_name
            decision = decide(gguf_name, plan[hf_name].shape, recipe)
            assert decision.ggml_type == "F32" and not decision.is_ternary and gguf_name in decision.reason


def test_transformers_bitnet_norm_names(cards: dict[str, Any]) -> None:
    card = copy.deepcopy(cards["bitnet"][1])
    card["hf_architecture"] = "BitNetForCausalLM"
    for entry in card["tensors"]:
        entry["name"] = (
            entry["name"].replace("inner_attn_ln", "attn_sub_norm").replace("ffn_layernorm", "ffn_sub_norm")
        )
    names = {p.hf_name: p.gguf_name for p in tensor_plan(ModelCard.from_dict(card))}
    assert names["model.layers.1.self_attn.attn_sub_norm.weight"] == "blk.1.attn_sub_norm.weight"
    assert names["model.layers.0.mlp.ffn_sub_norm.weight"] == "blk.0.ffn_sub_norm.weight"


def test_only_llama_family_permutes(cards: dict[str, Any]) -> None:
    for arch, is_permuted in (("mistral", True), ("qwen2", False), ("qwen3", False)):
        folder, card = cards[arch]
        files = {"model.safetensors": folder / "model.safetensors"}
        streamed = dict(iter_tensors(ModelCard.from_dict(card), files, "model.safetensors"))
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            raw = handle.get_tensor("model.layers.0.self_attn.k_proj.weight").float()
        assert torch.equal(streamed["blk.0.attn_k.weight"], raw) != is_permuted, arch


def test_bitnet_latent_weights_are_rounded(cards: dict[str, Any]) -> None:
    folder, card = cards["bitnet"]
    streamed = dict(
        iter_tensors(ModelCard.from_dict(card), {"model.safetensors": folder / "model.safetensors"},
                     "model.safetensors")
    )
    weight = streamed["blk.0.ffn_up.weight"]
    scale = weight.abs().max()
    assert set((weight / scale).unique().tolist()) == {-1.0, 0.0, 1.0}
    assert streamed["blk.0.attn_norm.weight"].unique().numel() > 3  # norms are not rounded
    assert torch.allclose(
        bitnet_weight_quant(torch.tensor([0.5, -2.0, 0.1, 0.0])), torch.tensor([0.65, -0.65, 0.0, 0.0])
    )


def test_refusals(cards: dict[str, Any]) -> None:
    bitnet = copy.deepcopy(cards["bitnet"][1])
    bitnet["tensors"].append({**bitnet["tensors"][0], "name": "lm_head.weight"})
    # Tied: the saved copy is dropped, llama.cpp reuses token_embd.
    tied = tensor_plan(ModelCard.from_dict(bitnet))
    assert "output.weight" not in {p.gguf_name for p in tied}
    bitnet["config"]["tie_word_embeddings"] = False
    with pytest.raises(InputError, match="untied lm_head"):
        tensor_plan(ModelCard.from_dict(bitnet))
    relu2 = copy.deepcopy(cards["bitnet"][1])
    relu2["config"]["hidden_act"] = "relu2"  # microsoft/bitnet-b1.58-2B-4T; llama.cpp's graph runs silu
    with pytest.raises(InputError, match="hidden_act 'relu2'"):
        tensor_plan(ModelCard.from_dict(relu2))
    swa = copy.deepcopy(cards["qwen2"][1])
    swa["config"]["use_sliding_window"] = True
    with pytest.raises(InputError, match="use_sliding_window"):
        tensor_plan(ModelCard.from_dict(swa))
    no_norm = copy.deepcopy(cards["qwen3"][1])
    no_norm["tensors"] = [t for t in no_norm["tensors"] if "q_norm" not in t["name"]]
    with pytest.raises(InputError, match=r"blk\.0\.attn_q_norm\.weight"):
        tensor_plan(ModelCard.from_dict(no_norm))


def _inspect_card(folder: Path, work: Path) -> dict[str, Any]:
    """The real checksum + inspect stages on `folder`: the model card later stages get."""
    import hashlib
    import json

    from pipeline.stages import checksum, inspect
    from pipeline.stages.base import InputFile

    inputs = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        inputs[f"download/{path.name}"] = InputFile(path.name, path, digest, path.stat().st_size)
    (work / "checksum").mkdir(parents=True)
    (manifest,) = checksum.run(checksum.Params(), inputs, work / "checksum").outputs
    digest = hashlib.sha256(manifest.path.read_bytes()).hexdigest()
    inputs["checksum/manifest.json"] = InputFile("manifest.json", manifest.path, digest, 0)
    (work / "inspect").mkdir()
    (card_file,) = inspect.run(inspect.Params(), inputs, work / "inspect").outputs
    card: dict[str, Any] = json.loads(card_file.path.read_text())
    return card


@pytest.mark.parametrize("arch", [spec.name for spec in ARCH_SPECS])
def test_inspect_stage_cards_every_architecture(cards: dict[str, Any], arch: str, tmp_path: Path) -> None:
    folder, _ = cards[arch]
    card = _inspect_card(folder, tmp_path)
    assert card["architecture"] == arch
    assert card["tokenizer"]["kind"] == ("sentencepiece" if arch in ("mistral", "bitnet") else "bpe")
    assert len(tensor_plan(ModelCard.from_dict(card))) == len(card["tensors"])


def test_bitnet_quant_method_is_native(cards: dict[str, Any], tmp_path: Path) -> None:
    import json
    import shutil

    folder = tmp_path / "bitnet"
    shutil.copytree(cards["bitnet"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "SHA256SUMS").unlink()
    assert _inspect_card(folder, tmp_path / "work")["architecture"] == "bitnet"
