"""The decompose stage on tiny checkpoints: part files, report, plot, fallbacks, shard fan-out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors import safe_open

from pipeline.core.errors import InputError
from pipeline.core.files import sha256_file
from pipeline.formats.model_card import ModelCard
from pipeline.stages.base import InputFile, JobSpec
from tests.conftest import card_for_checkpoint

source = pytest.importorskip("pipeline.formats.hf.checkpoint", reason="formats/hf/checkpoint.py is missing")
from pipeline.stages import decompose  # noqa: E402

_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
}


def _inputs(folder: Path, card: dict[str, Any], shards: list[str], src: Path | None = None,
            ) -> dict[str, InputFile]:
    card_path = folder / "model_card.json"
    card_path.write_text(json.dumps(card))
    items = {"inspect/model_card.json": card_path} | {f"download/{s}": (src or folder) / s for s in shards}
    return {k: InputFile(k.split("/", 1)[1], p, sha256_file(p), p.stat().st_size) for k, p in items.items()}


def _gaussian_model(folder: Path) -> dict[str, Any]:
    """Two-shard Llama, Gaussian weights, intermediate 320 (ffn_down rows not a multiple of 256)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    h, i, v, kv = 256, 320, 64, 128
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for b in range(2):
        p = f"model.layers.{b}"
        shapes |= {f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, h),
                   f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
                   f"{p}.mlp.down_proj.weight": (h, i), f"{p}.input_layernorm.weight": (h,),
                   f"{p}.post_attention_layernorm.weight": (h,)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    shard_of = {k: ("model-00001-of-00002.safetensors" if ".layers.1." not in k else
                    "model-00002-of-00002.safetensors") for k in tensors}
    for shard in sorted(set(shard_of.values())):
        save_file({k: t for k, t in tensors.items() if shard_of[k] == shard}, str(folder / shard))
    return {
        "architecture": "llama", "hf_architecture": "LlamaForCausalLM", "config": _CONFIG,
        "format": "safetensors", "shards": sorted(set(shard_of.values())),
        "tensors": [{"name": k, "shape": list(t.shape), "dtype": "BF16", "shard": shard_of[k]}
                    for k, t in tensors.items()],
    }


def test_ternary_demo_checkpoint_is_exact(demo_checkpoint: Path, demo_card: dict[str, Any],
                                          tmp_path: Path) -> None:
    inputs = _inputs(tmp_path, demo_card, demo_card["shards"], demo_checkpoint)
    work = tmp_path / "work"
    work.mkdir()
    result = decompose.run(decompose.make_params(JobSpec("demo")), inputs, work)
    kinds = {o.name: (o.kind, o.media_type) for o in result.outputs}
    assert kinds == {
        "ternary/part-00001.safetensors": ("ternary-part", "application/octet-stream"),
        "report.json": ("decompose-report", "application/json"),
        "sparsity.png": ("plot", "image/png"),
    }
    metrics = result.metrics
    assert metrics["n_ternary"] == 14 and metrics["n_fallback"] == 0 and metrics["device"] == "cpu"
    assert metrics["rel_error"] < 1e-6  # the demo weights are exactly scale * ternary
    assert 0.2 < metrics["sparsity"] < 0.45
    assert (work / "sparsity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((work / "report.json").read_text())
    assert set(report["layers"]) == {"0", "1"} and report["method"] == "optimal"
    row = next(t for t in report["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert row["ggml_type"] == "TQ2_0" and row["bits_per_weight"] == 2.0625
    assert row["absmean_rel_error"] > 0.05  # absmean does not recover ternary weights exactly
    assert result.warnings == ()


def test_gaussian_two_shards_with_fallbacks(tmp_path: Path) -> None:
    card = _gaussian_model(tmp_path)
    inputs = _inputs(tmp_path, card, card["shards"])
    work = tmp_path / "work"
    work.mkdir()
    result = decompose.run(decompose.make_params(JobSpec("x", options={"irls_iters": 1})), inputs, work)
    report = json.loads((work / "report.json").read_text())
    assert [f["name"] for f in report["fallbacks"]] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    assert "row length 320 is not a multiple of 256" in result.warnings[0]
    assert result.metrics["n_ternary"] == 12 and result.metrics["n_fallback"] == 2
    assert 0.40 < result.metrics["rel_error"] < 0.47 < 0.49 < result.metrics["absmean_rel_error"] < 0.53
    parts = sorted(o.path for o in result.outputs if o.kind == "ternary-part")
    assert [p.name for p in parts] == ["part-00001.safetensors", "part-00002.safetensors"]
    # The bytes are GGUF blocks: gguf's own dequantize gives back the reported error.
    files = {s: tmp_path / s for s in card["shards"]}
    src = dict(source.iter_tensors(ModelCard.from_dict(card), files, card["shards"][1]))
    index = decompose.read_part_index(parts[1]).by_name()
    up = index["blk.1.ffn_up.weight"]
    assert (up.ggml_type, up.shape) == ("TQ2_0", (320, 256))
    # The source is BF16: a fallback keeps the source's own 16-bit type by default.
    assert index["blk.1.ffn_down.weight"].ggml_type == "BF16"
    with safe_open(str(parts[1]), framework="numpy") as handle:
        raw = handle.get_tensor("blk.1.ffn_up.weight")
    assert raw.dtype == np.uint8 and raw.size == 320 * 66
    values = quants.dequantize(raw.reshape(320, -1), GGMLQuantizationType.TQ2_0)
    w = src["blk.1.ffn_up.weight"].numpy()
    rel = float(np.linalg.norm(w - values) / np.linalg.norm(w))
    row = next(t for t in report["tensors"] if t["name"] == "blk.1.ffn_up.weight")
    assert rel == pytest.approx(row["rel_error"], rel=1e-4)


def test_fan_out_one_shard_tq1_0(tmp_path: Path) -> None:
    card = _gaussian_model(tmp_path)
    inputs = _inputs(tmp_path, card, card["shards"])
    work = tmp_path / "work"
    work.mkdir()
    job = JobSpec("x", recipe="tq1_0", options={"shards": [card["shards"][1]], "device": "cpu"})
    result = decompose.run(decompose.make_params(job), inputs, work)
    parts = [o.name for o in result.outputs if o.kind == "ternary-part"]
    assert parts == ["ternary/part-00002.safetensors"]
    index = decompose.read_part_index(work / parts[0]).by_name()
    assert index["blk.1.attn_q.weight"].ggml_type == "TQ1_0"
    assert "token_embd.weight" not in index and result.metrics["ternary_bpw"] == 1.6875


def test_refusals(tmp_path: Path) -> None:
    card = _gaussian_model(tmp_path)
    with pytest.raises(InputError, match="known recipes"):
        decompose.make_params(JobSpec("x", recipe="q4"))
    with pytest.raises(InputError, match="device"):
        decompose.make_params(JobSpec("x", options={"device": "tpu"}))
    inputs = _inputs(tmp_path, card, card["shards"][:1])
    params = decompose.make_params(JobSpec("x"))
    with pytest.raises(InputError, match="model-00002-of-00002"):
        decompose.run(params, inputs, tmp_path)
    del inputs["inspect/model_card.json"]
    with pytest.raises(InputError, match="model_card.json"):
        decompose.run(params, inputs, tmp_path)


def test_tensors_read_as_stored_equal_the_float32_ones(tmp_path: Path) -> None:
    """BF16 weights come as stored (rows already permuted for rope); values equal the float32 path's."""
    card = _gaussian_model(tmp_path)
    files = {s: tmp_path / s for s in card["shards"]}
    shard = card["shards"][0]
    # Kept: every tensor its own memory.
    as_float = dict(source.iter_tensors(ModelCard.from_dict(card), files, shard))
    seen = set()
    for name, tensor in source.iter_tensors(ModelCard.from_dict(card), files, shard, as_stored=True):
        assert tensor.dtype == torch.bfloat16  # this checkpoint stores everything as BF16
        assert torch.equal(tensor.float(), as_float[name]), name
        seen.add(name)
    assert seen == set(as_float) and "blk.0.attn_q.weight" in seen


def test_dropped_tensors_memory_is_reused(tmp_path: Path) -> None:
    from pipeline.formats.rawio import ReusableBuffers

    pool = ReusableBuffers(np.uint8, keep=2)
    first = pool.get(100)
    address = first.ctypes.data
    held = torch.frombuffer(first, dtype=torch.uint8)
    del first
    second = pool.get(50)  # the first buffer is still viewed by a tensor
    assert second.ctypes.data != address
    del held, second
    assert pool.get(80).ctypes.data == address  # every view gone: reused


def _decompose(tmp_path: Path, checkpoint: Path, recipe: str = "tq2_0", **options: Any) -> Any:
    card = card_for_checkpoint(checkpoint)
    inputs = _inputs(tmp_path, card, card["shards"], checkpoint)
    work = tmp_path / "-".join(["work", recipe, *(f"{k}={v}" for k, v in sorted(options.items()))])
    work.mkdir()
    return decompose.run(decompose.make_params(JobSpec("demo", recipe, options)), inputs, work), work


def test_exactness_is_proven_on_the_bytes_written(demo_checkpoint: Path, tmp_path: Path) -> None:
    # The demo's linear weights are exactly ternary; its BF16 embedding and head round a little in F16.
    lossy_f16, _ = _decompose(tmp_path, demo_checkpoint, embed_type="F16", output_type="F16")
    assert lossy_f16.metrics["exact"] is False and lossy_f16.metrics["n_inexact"] == 2
    assert "embed_type=bf16" in lossy_f16.metrics["exact_note"]
    # By default they keep the source's BF16: exact, as are the explicit types.
    for options in ({}, {"embed_type": "BF16", "output_type": "BF16"}):
        exact, work = _decompose(tmp_path, demo_checkpoint, **options)
        assert exact.metrics["exact"] is True and exact.metrics["n_inexact"] == 0
    # A target whose backend lacks BF16 (Metal, in part) gets F16, and the rounding is named.
    metal, _ = _decompose(tmp_path, demo_checkpoint, target="metal")
    assert metal.metrics["exact"] is False and "embed_type=bf16" in metal.metrics["exact_note"]
    assert exact.metrics["exact"] is True and exact.metrics["n_inexact"] == 0
    report = json.loads((work / "report.json").read_text())
    assert report["exact"] is True and all(t["exact"] for t in report["tensors"])


def test_a_checkpoint_with_a_scale_per_128_inputs_is_exact_in_q2_0_not_tq2_0(demo_checkpoint: Path,
                                                                            tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "per128"
    shutil.copytree(demo_checkpoint, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name, weight in tensors.items():
        if name.endswith("proj.weight"):  # ternary codes times one fp16-exact scale per 128 inputs
            codes = torch.sign(weight.float())
            scales = (torch.rand(weight.shape[0], weight.shape[1] // 128, generator=gen) * 0.02 + 0.01).half()
            tensors[name] = (codes * scales.float().repeat_interleave(128, dim=1)).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    options = {"embed_type": "BF16", "output_type": "BF16"}
    tq2, _ = _decompose(tmp_path, folder, "tq2_0", **options)
    assert tq2.metrics["exact"] is False and tq2.metrics["exact_type"] == "Q2_0"
    assert any("--recipe q2_0 converts them without loss" in w for w in tq2.warnings)
    q2, _ = _decompose(tmp_path, folder, "q2_0", **options)
    assert q2.metrics["exact"] is True and q2.warnings == ()
