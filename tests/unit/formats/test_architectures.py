"""Each architecture end to end: demo checkpoint -> decompose -> package -> llama.cpp logits vs plain torch.

Two conversions per architecture. The real pipeline (decompose with the tq2_0 recipe, then
package) must load and agree with a plain-torch forward of the HF checkpoint within what
llama.cpp's TQ2_0 kernels allow (they round activations to 8 bits per 256-block). The layout
proof packages a sharpened copy (q/k scaled so attention is far from uniform) with F32 parts,
so only layout can differ: a rope permutation mistake, a dropped bias or a skipped norm moves
the logits well past the tight tolerance, and each test computes the reference with that
feature left out to show it would have noticed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import card_for_checkpoint, package_inputs
from safetensors.torch import load_file, save_file

from pipeline.core.files import sha256_file
from pipeline.demo.checkpoint import write_demo_checkpoint
from pipeline.stages import decompose, package
from pipeline.stages.base import InputFile, JobSpec
from pipeline.stages.inspect.stage import SUPPORTED_ARCHITECTURES
from tests.support.reference_forward import reference_logits

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "bitnet")
# The feature of each architecture whose absence the logit test must notice.
ABLATION = {
    "llama": ("rope_layout",),
    "mistral": ("rope_layout",),
    "qwen2": ("bias",),
    "qwen3": ("qk_norm",),
    "bitnet": ("weight_quant", "sub_norm"),
}
_PROMPT = b"1+1=2, 2+2=4 and the quick brown fox jumps"
# F32 weights: llama.cpp differs from torch by its F16 KV cache only (measured below 0.5% of
# the largest logit); a layout mistake costs tens of percent.
_LAYOUT_TOLERANCE = 0.02
# TQ2_0 weights are exact, but llama.cpp multiplies them with activations rounded to Q8_K
# (8 bits per 256 values): measured 2-3.5% of the largest logit on these tiny models.
_TQ2_0_TOLERANCE = 0.06


def _sharpen(folder: Path, architecture: str) -> None:
    """Scale what sets attention logits, so attention is sharp and layout mistakes are visible."""
    tensors = load_file(str(folder / "model.safetensors"))
    # Qwen3 normalises q and k per head, so only its q/k norm weights set their size.
    targets = ("q_norm.weight", "k_norm.weight") if architecture == "qwen3" else ("q_proj.", "k_proj.")
    # Qwen2's q/k biases scale too, and 16x makes its F16 KV cache round the logits by ~5%.
    factor = 4.0 if architecture in ("qwen2", "qwen3") else 16.0
    for name in tensors:
        if any(t in name for t in targets):
            tensors[name] = (tensors[name].float() * factor).to(torch.bfloat16)
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _input(key: str, path: Path) -> tuple[str, InputFile]:
    return key, InputFile(key.split("/", 1)[1], path, sha256_file(path), path.stat().st_size)


def _card(checkpoint: Path, tmp: Path) -> tuple[dict[str, Any], Path]:
    card = card_for_checkpoint(checkpoint)
    card["architecture"] = SUPPORTED_ARCHITECTURES[card["hf_architecture"]]
    card_path = tmp / "model_card.json"
    card_path.write_text(json.dumps(card), encoding="utf-8")
    return card, card_path


def _convert(architecture: str, tmp: Path) -> dict[str, Any]:
    """The real decompose + package stages on the demo checkpoint of `architecture`."""
    checkpoint = write_demo_checkpoint(tmp / "checkpoint", architecture=architecture)
    _, card_path = _card(checkpoint, tmp)
    downloads = dict(_input(f"download/{p.name}", p) for p in sorted(checkpoint.iterdir()))
    inputs = {**downloads, **dict([_input("inspect/model_card.json", card_path)])}
    job = JobSpec(source=f"local/demo-{architecture}", options={"device": "cpu"})
    (tmp / "decompose").mkdir()
    decomposed = decompose.run(decompose.make_params(job), inputs, tmp / "decompose")
    parts = dict(
        _input(f"decompose/{o.name}", o.path) for o in decomposed.outputs if o.kind == "ternary-part"
    )
    (tmp / "package").mkdir()
    packaged = package.run(package.make_params(job), {**inputs, **parts}, tmp / "package")
    report = json.loads((tmp / "decompose" / "report.json").read_text())
    return {"checkpoint": checkpoint, "gguf": packaged.outputs[0].path, "package": packaged, "report": report}


def _convert_f32(architecture: str, tmp: Path) -> dict[str, Any]:
    """The package stage on a sharpened demo checkpoint, with every tensor in F32 parts."""
    checkpoint = write_demo_checkpoint(tmp / "sharp", architecture=architecture)
    _sharpen(checkpoint, architecture)
    card, _ = _card(checkpoint, tmp)
    inputs = package_inputs(checkpoint, card, tmp, ternary="F32")
    (tmp / "work").mkdir()
    job = JobSpec(source=f"local/sharp-{architecture}")
    packaged = package.run(package.make_params(job), inputs, tmp / "work")
    return {"checkpoint": checkpoint, "gguf": packaged.outputs[0].path}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[tuple[str, bool], dict[str, Any]] = {}

    def get(architecture: str, is_layout_proof: bool = False) -> dict[str, Any]:
        key = (architecture, is_layout_proof)
        if key not in cache:
            tmp = tmp_path_factory.mktemp(architecture)
            cache[key] = (_convert_f32 if is_layout_proof else _convert)(architecture, tmp)
        return cache[key]

    return get


def _llama_cpp_logits(path: Path) -> tuple[list[int], np.ndarray]:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(
        model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False, seed=0
    )
    ids = model.tokenize(_PROMPT, add_bos=True)
    model.eval(ids)
    return ids, np.asarray(model.scores[: len(ids)])


def _field(path: Path, key: str) -> Any:
    found = gguf.GGUFReader(path).get_field(key)
    return None if found is None else found.contents()


@pytest.mark.parametrize(
    ("architecture", "gguf_arch", "tokenizer_model", "extra_tensors"),
    [
        ("llama", "llama", "gpt2", ()),
        ("mistral", "llama", "llama", ()),
        ("qwen2", "qwen2", "gpt2", ("blk.0.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias")),
        ("qwen3", "qwen3", "gpt2", ("blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight")),
        ("bitnet", "bitnet", "llama", ("blk.0.attn_sub_norm.weight", "blk.1.ffn_sub_norm.weight")),
    ],
)
def test_packaged_architecture(
    converted: Any, architecture: str, gguf_arch: str, tokenizer_model: str, extra_tensors: tuple[str, ...]
) -> None:
    result = converted(architecture)
    path = result["gguf"]
    assert _field(path, "general.architecture") == gguf_arch
    assert _field(path, "tokenizer.ggml.model") == tokenizer_model
    config = json.loads((result["checkpoint"] / "config.json").read_text())
    assert _field(path, f"{gguf_arch}.rope.freq_base") == pytest.approx(config["rope_theta"])
    eps = _field(path, f"{gguf_arch}.attention.layer_norm_rms_epsilon")
    assert eps == pytest.approx(config["rms_norm_eps"])
    assert _field(path, f"{gguf_arch}.attention.key_length") == config["head_dim"]
    assert _field(path, f"{gguf_arch}.attention.head_count_kv") == config["num_key_value_heads"]
    if architecture != "llama":  # the Llama demo keeps its original tokenizer_config (no template)
        assert "{{" in _field(path, "tokenizer.chat_template")
    rows = {row["name"]: row for row in result["report"]["tensors"]}
    for name in extra_tensors:
        assert rows[name]["ggml_type"] == "F32" and not rows[name]["is_ternary"], name
        assert name in rows[name]["reason"] and "1-D" in rows[name]["reason"]
    assert rows["blk.0.attn_q.weight"]["ggml_type"] == "TQ2_0"
    # Tied checkpoints carry no output head; llama.cpp falls back to token_embd.
    assert ("output.weight" in rows) == (not config["tie_word_embeddings"])


def test_qwen3_head_dim_differs_from_hidden_over_heads(converted: Any) -> None:
    rows = {row["name"]: row for row in converted("qwen3")["report"]["tensors"]}
    assert rows["blk.0.attn_q.weight"]["shape"] == [512, 256]  # 4 heads x 128
    assert rows["blk.0.attn_output.weight"]["shape"] == [256, 512]
    assert rows["blk.0.attn_q_norm.weight"]["shape"] == [128]


def test_bitnet_latent_weights_become_exact_ternary(converted: Any) -> None:
    # After BitNet's absmean rounding every linear weight is scale x {-1,0,+1}: lossless in TQ2_0
    # up to the fp16 block scale.
    rows = converted("bitnet")["report"]["tensors"]
    linear = [r for r in rows if r["is_ternary"]]
    assert len(linear) == 14
    assert max(r["rel_error"] for r in linear) < 1e-3


@pytest.mark.llama
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_pipeline_output_runs_in_llama_cpp(converted: Any, architecture: str) -> None:
    """The real decompose (tq2_0) + package output: loads, and computes what the HF model computes."""
    result = converted(architecture)
    ids, got = _llama_cpp_logits(result["gguf"])
    expected = reference_logits(result["checkpoint"], ids)
    diff = np.abs(got - expected).max() / np.abs(expected).max()
    print(f"{architecture} TQ2_0: max |llama.cpp - torch| = {diff:.2%} of the largest logit")
    assert diff < _TQ2_0_TOLERANCE
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.9


@pytest.mark.llama
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_layout_matches_reference_forward(converted: Any, architecture: str) -> None:
    """F32 weights and sharp attention: names, rope layout, biases and norms right, or the logits drift."""
    result = converted(architecture, is_layout_proof=True)
    ids, got = _llama_cpp_logits(result["gguf"])
    expected = reference_logits(result["checkpoint"], ids)
    scale = np.abs(expected).max()
    diff = np.abs(got - expected).max() / scale
    ablated = {
        feature: np.abs(got - reference_logits(result["checkpoint"], ids, ablate=feature)).max() / scale
        for feature in ABLATION[architecture]
    }
    shown = ", ".join(f"without {k}: {v:.1%}" for k, v in ablated.items())
    print(f"{architecture} F32: {diff:.3%} of the largest logit; {shown}")
    assert diff < _LAYOUT_TOLERANCE
    assert np.array_equal(got.argmax(-1), expected.argmax(-1))
    assert min(ablated.values()) > 5 * _LAYOUT_TOLERANCE, "the test would not notice a missing feature"
