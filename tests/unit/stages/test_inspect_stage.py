"""Inspect stage: the model card's shape, and a refusal with a reason for every bad checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pipeline.core.errors import InputError, IntegrityError
from pipeline.stages import checksum, inspect
from pipeline.stages.base import InputFile, StageResult

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "vocab_size": 16,
}
TOKENIZER = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(8, dtype=torch.float32),
        "lm_head.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
    }


def _checkpoint(root: Path, *, config: dict[str, Any] | None = None, sharded: bool = False) -> Path:
    folder = root / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    (folder / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (folder / "tokenizer_config.json").write_text("{}")
    tensors = _tensors()
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, members in parts.items():
        save_file({n: tensors[n] for n in members}, str(folder / shard))
        weight_map.update({n: shard for n in members})
    _write_index(folder, weight_map)
    return folder


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )


def _inputs(folder: Path, work: Path) -> dict[str, InputFile]:
    """Download-style inputs for every file of `folder`, plus a real checksum manifest."""
    inputs = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        inputs[f"download/{name}"] = InputFile(name, path, digest, path.stat().st_size)
    check_dir = work / "checksum"
    check_dir.mkdir(parents=True, exist_ok=True)
    (manifest,) = checksum.run(checksum.Params(), inputs, check_dir).outputs
    digest = hashlib.sha256(manifest.path.read_bytes()).hexdigest()
    inputs["checksum/manifest.json"] = InputFile("manifest.json", manifest.path, digest, 0)
    return inputs


def _inspect(folder: Path, tmp_path: Path) -> tuple[dict[str, Any], StageResult]:
    work = tmp_path / "work"
    inputs = _inputs(folder, work)
    out = work / "inspect"
    out.mkdir()
    result = inspect.run(inspect.Params(), inputs, out)
    (card_file,) = result.outputs
    assert card_file.name == "model_card.json" and card_file.kind == "model-card"
    return json.loads(card_file.path.read_text()), result


def test_card_shape_single_file(tmp_path: Path) -> None:
    card, result = _inspect(_checkpoint(tmp_path), tmp_path)
    assert list(card) == [
        "architecture", "hf_architecture", "config", "format", "shards", "tensors",
        "param_count", "dtypes", "tokenizer",
    ]
    assert card["architecture"] == "llama" and card["hf_architecture"] == "LlamaForCausalLM"
    assert card["config"] == CONFIG
    assert card["format"] == "safetensors" and card["shards"] == ["model.safetensors"]
    assert card["tensors"][0] == {"name": "lm_head.weight", "shape": [16, 8], "dtype": "BF16",
                                  "shard": "model.safetensors"}
    assert [t["name"] for t in card["tensors"]] == sorted(_tensors())
    assert card["param_count"] == 16 * 8 * 2 + 64 + 8
    assert card["dtypes"] == {"BF16": 3, "F32": 1}
    assert card["tokenizer"] == {"kind": "bpe", "files": ["tokenizer.json", "tokenizer_config.json"]}
    assert result.metrics["n_tensors"] == 4 and result.metrics["architecture"] == "llama"
    assert result.metrics["param_count"] == card["param_count"]


def test_card_matches_demo_checkpoint(
    demo_checkpoint: Path, demo_card: dict[str, Any], tmp_path: Path
) -> None:
    card, _ = _inspect(demo_checkpoint, tmp_path)
    for key in ("architecture", "hf_architecture", "config", "format", "shards", "tokenizer"):
        assert card[key] == demo_card[key], key
    by_name = sorted(demo_card["tensors"], key=lambda t: t["name"])
    assert sorted(card["tensors"], key=lambda t: t["name"]) == by_name


def test_sharded_with_index(tmp_path: Path) -> None:
    card, _ = _inspect(_checkpoint(tmp_path, sharded=True), tmp_path)
    assert card["shards"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert {t["shard"] for t in card["tensors"]} == set(card["shards"])
    assert len(card["tensors"]) == 4


def test_index_with_traversal_name(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, sharded=True)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map["lm_head.weight"] = "../outside/evil.safetensors"
    _write_index(folder, weight_map)
    with pytest.raises(InputError, match=r"index.json: tensor 'lm_head.weight'.*escapes the snapshot"):
        _inspect(folder, tmp_path)


def test_index_with_absolute_name(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, sharded=True)
    _write_index(folder, {"lm_head.weight": "/etc/passwd.safetensors"})
    with pytest.raises(InputError, match="escapes"):
        _inspect(folder, tmp_path)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, sharded=True)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map["extra.weight"] = "model-00003-of-00003.safetensors"
    _write_index(folder, weight_map)
    with pytest.raises(IntegrityError, match="'extra.weight' lives in shard 'model-00003-of-00003"):
        _inspect(folder, tmp_path)


def test_index_tensor_not_in_shard(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, sharded=True)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map["ghost.weight"] = "model-00001-of-00002.safetensors"
    _write_index(folder, weight_map)
    with pytest.raises(IntegrityError, match="1 tensor.*not found.*'ghost.weight'"):
        _inspect(folder, tmp_path)


def test_shard_tensor_missing_from_index(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, sharded=True)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    del weight_map["lm_head.weight"]
    _write_index(folder, weight_map)
    with pytest.raises(IntegrityError, match="holds tensor 'lm_head.weight' but .* omits it"):
        _inspect(folder, tmp_path)


def test_missing_config(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(InputError, match="config.json is missing"):
        _inspect(folder, tmp_path)


def test_config_not_json(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json: not valid JSON"):
        _inspect(folder, tmp_path)


def test_config_without_architecture(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="neither 'architectures' nor 'model_type'"):
        _inspect(_checkpoint(tmp_path, config={"hidden_size": 8}), tmp_path)


def test_model_type_only_is_enough(tmp_path: Path) -> None:
    card, _ = _inspect(_checkpoint(tmp_path, config={"model_type": "llama"}), tmp_path)
    assert card["hf_architecture"] == "LlamaForCausalLM"


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = {**CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(InputError) as info:
        _inspect(_checkpoint(tmp_path, config=config), tmp_path)
    assert "'GPT2LMHeadModel' is not supported" in str(info.value)
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(info.value)


def test_pickle_only_checkpoint(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(InputError, match=r"pickle-only checkpoint \(pytorch_model.bin\).*never unpickled"):
        _inspect(folder, tmp_path)


def test_pickle_beside_safetensors_is_ignored_with_warning(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "training_args.bin").write_bytes(b"\x80\x04")
    _, result = _inspect(folder, tmp_path)
    assert any("training_args.bin" in w for w in result.warnings)


def test_no_weights_at_all(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no .safetensors weights"):
        _inspect(folder, tmp_path)


def test_several_safetensors_without_index(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    shutil.move(folder / "model.safetensors", folder / "a.safetensors")
    shutil.copy(folder / "a.safetensors", folder / "b.safetensors")
    with pytest.raises(InputError, match="2 safetensors files.*no model.safetensors.index.json"):
        _inspect(folder, tmp_path)


def test_impostor_quantization_config(tmp_path: Path) -> None:
    config = {**CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(InputError, match="quantization_config \\(quant_method='gptq'\\).*already quantized"):
        _inspect(_checkpoint(tmp_path, config=config), tmp_path)


def test_impostor_gptq_tensors(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    save_file(
        {
            "model.layers.0.self_attn.q_proj.qweight": torch.zeros(1, 8, dtype=torch.int32),
            "model.layers.0.self_attn.q_proj.qzeros": torch.zeros(1, 1, dtype=torch.int32),
            "model.layers.0.self_attn.q_proj.scales": torch.zeros(1, 8, dtype=torch.float16),
        },
        str(folder / "model.safetensors"),
    )
    with pytest.raises(InputError, match="q_proj.q(weight|zeros).*already quantized"):
        _inspect(folder, tmp_path)


def test_impostor_int8_weights(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 8, dtype=torch.int8)},
              str(folder / "model.safetensors"))
    with pytest.raises(InputError, match="'model.layers.0.mlp.up_proj.weight' is stored as I8"):
        _inspect(folder, tmp_path)


def test_impostor_quantizer_file(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "quantize_config.json").write_text('{"bits": 4}')
    with pytest.raises(InputError, match="quantize_config.json: a GPTQ/AWQ"):
        _inspect(folder, tmp_path)


def test_truncated_safetensors(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(IntegrityError, match=r"model.safetensors: tensor .* \(truncated\?\)"):
        _inspect(folder, tmp_path)


def test_sentencepiece_tokenizer(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    (folder / "tokenizer.model").write_bytes(b"\x0a\x00")
    card, _ = _inspect(folder, tmp_path)
    assert card["tokenizer"]["kind"] == "sentencepiece"
    assert "tokenizer.model" in card["tokenizer"]["files"]


def test_manifest_required_and_checked(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path)
    inputs = _inputs(folder, tmp_path / "w")
    out = tmp_path / "out"
    out.mkdir()
    without = {k: v for k, v in inputs.items() if k != "checksum/manifest.json"}
    with pytest.raises(InputError, match="checksum/manifest.json"):
        inspect.run(inspect.Params(), without, out)
    item = inputs["download/config.json"]
    inputs["download/config.json"] = InputFile(item.name, item.path, "0" * 64, item.size_bytes)
    with pytest.raises(IntegrityError, match="config.json: differs from the checksum manifest"):
        inspect.run(inspect.Params(), inputs, out)


# --- GGUF sources ---------------------------------------------------------------------------

def _gguf(path: Path, *, arch: str = "llama", quantized: bool = False, integer: bool = False) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    if quantized:
        raw = np.zeros((2, 144), dtype=np.uint8)  # two rows of one Q4_K block (256 weights)
        writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    if integer:
        writer.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 8), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_folder(tmp_path: Path, **kwargs: Any) -> Path:
    folder = tmp_path / "g"
    folder.mkdir()
    _gguf(folder / "model-f16.gguf", **kwargs)
    return folder


def test_gguf_card(tmp_path: Path) -> None:
    card, result = _inspect(_gguf_folder(tmp_path), tmp_path)
    assert card["format"] == "gguf" and card["architecture"] == "llama"
    assert card["shards"] == ["model-f16.gguf"]
    assert {"name": "token_embd.weight", "shape": [16, 8], "dtype": "F16", "shard": "model-f16.gguf"} in card[
        "tensors"
    ]
    assert card["param_count"] == 16 * 8 + 8
    assert card["dtypes"] == {"F16": 1, "F32": 1}
    assert card["tokenizer"] == {"kind": "bpe", "files": ["model-f16.gguf"]}
    assert card["config"]["general.architecture"] == "llama"
    assert result.metrics["dtypes"] == {"F16": 1, "F32": 1}


def test_gguf_quantized_source_is_accepted_with_its_types(tmp_path: Path) -> None:
    card, result = _inspect(_gguf_folder(tmp_path, quantized=True), tmp_path)
    assert card["dtypes"] == {"F16": 1, "F32": 1, "Q4_K": 1}
    entry = {"name": "blk.0.ffn_up.weight", "shape": [2, 256], "dtype": "Q4_K", "shard": "model-f16.gguf"}
    assert entry in card["tensors"]
    assert result.metrics["dtypes"]["Q4_K"] == 1


def test_gguf_integer_tensor_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="'blk.0.ffn_up.weight' is I32, which gguf cannot dequantize"):
        _inspect(_gguf_folder(tmp_path, integer=True), tmp_path)


def test_gguf_any_llama_cpp_architecture(tmp_path: Path) -> None:
    card, _ = _inspect(_gguf_folder(tmp_path, arch="gemma3"), tmp_path)
    assert card["architecture"] == "gemma3"


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="GGUF architecture 'no-such-arch' is not one llama.cpp knows"):
        _inspect(_gguf_folder(tmp_path, arch="no-such-arch"), tmp_path)


def test_gguf_truncated(tmp_path: Path) -> None:
    folder = _gguf_folder(tmp_path)
    path = folder / "model-f16.gguf"
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(IntegrityError, match="truncated"):
        _inspect(folder, tmp_path)


def _hostile_gguf(folder: Path, body: bytes, *, n_tensors: int = 0, n_kv: int = 1) -> Path:
    folder.mkdir()
    (folder / "x.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body)
    return folder


@pytest.mark.parametrize(
    ("body", "counts", "pattern"),
    [
        # An array claiming 2**60 bytes: gguf's reader would spin on empty reads.
        (struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 2**60), {}, "needs .* bytes"),
        (struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 8, 2**40), {}, "claims 1099511627776 strings"),
        (struct.pack("<Q", 2**62) + b"a" * 16, {}, "needs .* bytes"),
        (b"", {"n_kv": 2**40}, "more than .* bytes can hold"),
        (b"", {"n_tensors": 2**63, "n_kv": 0}, "more than .* bytes can hold"),
        (struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9) + b"\0" * 80, {"n_tensors": 1, "n_kv": 0},
         "9 dimensions"),
        (struct.pack("<Q", 1) + b"a" + struct.pack("<I", 77) + b"\0" * 16, {}, "unknown value type"),
    ],
)
def test_gguf_hostile_counts_fail_fast(
    tmp_path: Path, body: bytes, counts: dict[str, int], pattern: str
) -> None:
    folder = _hostile_gguf(tmp_path / "g", body, **counts)
    started = time.perf_counter()
    with pytest.raises(IntegrityError, match=pattern):
        _inspect(folder, tmp_path)
    assert time.perf_counter() - started < 5


def test_gguf_bad_magic(tmp_path: Path) -> None:
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(b"NOPE" + b"\0" * 40)
    with pytest.raises(InputError, match="not a GGUF file"):
        _inspect(folder, tmp_path)


def test_download_checksum_inspect_chain_on_demo(demo_checkpoint: Path, tmp_path: Path) -> None:
    from pipeline.stages import download

    def as_inputs(stage: str, result: StageResult) -> dict[str, InputFile]:
        return {
            f"{stage}/{o.name}": InputFile(o.name, o.path, hashlib.sha256(o.path.read_bytes()).hexdigest(),
                                           o.path.stat().st_size)
            for o in result.outputs
        }

    dirs = {name: tmp_path / name for name in ("download", "checksum", "inspect")}
    for folder in dirs.values():
        folder.mkdir()
    fetched = as_inputs("download", download.run(download.Params(str(demo_checkpoint)), {}, dirs["download"]))
    checked = checksum.run(checksum.Params(), fetched, dirs["checksum"])
    assert checked.metrics["verified_against"] == ["SHA256SUMS"]
    result = inspect.run(inspect.Params(), {**fetched, **as_inputs("checksum", checked)}, dirs["inspect"])
    assert result.metrics["architecture"] == "llama" and result.metrics["n_tensors"] > 0
