"""Inspect cross-checks config.json against the tensor shapes, for every architecture in ARCH_SPECS.

An attacker's config.json with a `hidden_size` the tensors do not have used to pass inspect,
decompose and package into a GGUF llama.cpp could not load. Each lie below (hidden size, head
counts, head size, feed-forward size, vocabulary, layer count) must now be refused at inspect,
and the message must name a real tensor, the shape config.json implies and the shape found.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.errors import InputError
from pipeline.demo.checkpoint import write_demo_checkpoint
from pipeline.formats.hf.architectures import ARCH_SPECS
from pipeline.formats.safetensors import read_header
from pipeline.stages import checksum, inspect
from pipeline.stages.base import InputFile
from pipeline.stages.inspect.shape_check import check_shapes

ARCHS = [spec.name for spec in ARCH_SPECS]
_SHAPE_MESSAGE = re.compile(
    r"tensor '([^']+)': expected shape \[([^\]]*)\] from config.json, found \[([^\]]*)\]"
)


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shape-demos")
    return {name: write_demo_checkpoint(root / name, architecture=name) for name in ARCHS}


def _inspect(folder: Path, config: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run checksum + inspect over `folder`'s files with `config` as its config.json."""
    work.mkdir(parents=True)
    config_path = work / "config.json"
    config_path.write_text(json.dumps(config))
    inputs: dict[str, InputFile] = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != "SHA256SUMS"):
        path = config_path if path.name == "config.json" else path
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        inputs[f"download/{path.name}"] = InputFile(path.name, path, digest, path.stat().st_size)
    (work / "checksum").mkdir()
    (manifest,) = checksum.run(checksum.Params(), inputs, work / "checksum").outputs
    inputs["checksum/manifest.json"] = InputFile("manifest.json", manifest.path, "", 0)
    (work / "inspect").mkdir()
    (card,) = inspect.run(inspect.Params(), inputs, work / "inspect").outputs
    return dict(json.loads(card.path.read_text()))


def _config(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "config.json").read_text()))


def _lies(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each config.json lie: its name -> the changed keys."""
    return {
        "hidden_size": {"hidden_size": config["hidden_size"] * 2},
        "num_attention_heads": {"num_attention_heads": config["num_attention_heads"] * 2},
        "num_key_value_heads": {"num_key_value_heads": config["num_key_value_heads"] * 2},
        "head_dim": {"head_dim": config["head_dim"] // 2},
        "intermediate_size": {"intermediate_size": config["intermediate_size"] + 256},
        "vocab_size": {"vocab_size": config["vocab_size"] + 1},
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_honest_demo_passes(arch: str, demos: dict[str, Path], tmp_path: Path) -> None:
    card = _inspect(demos[arch], _config(demos[arch]), tmp_path / "w")
    assert card["architecture"] == arch


@pytest.mark.parametrize("lie", ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size", "vocab_size"])
@pytest.mark.parametrize("arch", ARCHS)
def test_lying_dimension_refused_naming_tensor_expected_and_found(
    arch: str, lie: str, demos: dict[str, Path], tmp_path: Path
) -> None:
    folder = demos[arch]
    honest = _config(folder)
    changed = _lies(honest)[lie]
    with pytest.raises(InputError) as caught:
        _inspect(folder, {**honest, **changed}, tmp_path / "w")
    message = str(caught.value)
    match = _SHAPE_MESSAGE.search(message)
    assert match, message
    tensor, expected, found = match.group(1), match.group(2), match.group(3)
    stored = {t.name: list(t.shape) for t in read_header(folder / "model.safetensors").tensors}
    assert tensor in stored, message
    assert found == ", ".join(str(d) for d in stored[tensor]), message
    assert expected != found, message
    assert f"{lie} {changed[lie]}" in message, message
    assert "Traceback" not in message


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("delta", [1, -1])
def test_lying_layer_count_refused(arch: str, delta: int, demos: dict[str, Path], tmp_path: Path) -> None:
    folder = demos[arch]
    honest = _config(folder)
    lie = honest["num_hidden_layers"] + delta
    with pytest.raises(InputError) as caught:
        _inspect(folder, {**honest, "num_hidden_layers": lie}, tmp_path / "w")
    message = str(caught.value)
    assert f"num_hidden_layers is {lie}" in message, message
    assert f"expected {lie} layer(s), found" in message, message
    assert re.search(r"'model\.layers\.\d+\.[^']+'", message), message


@pytest.mark.parametrize("value", [0, -4, "256", 2.5, True, [256]])
def test_non_integer_hyperparameter_refused(value: Any, demos: dict[str, Path], tmp_path: Path) -> None:
    folder = demos["llama"]
    with pytest.raises(InputError, match=r"config.json key 'hidden_size' is .*expected a positive integer"):
        _inspect(folder, {**_config(folder), "hidden_size": value}, tmp_path / "w")


def test_default_head_dim_and_kv_heads_follow_the_package_stage() -> None:
    # No head_dim, no num_key_value_heads: head_dim = hidden / heads, kv heads = heads.
    spec = ARCH_SPECS[0]
    config = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1}
    good = [("model.layers.0.self_attn.k_proj.weight", (256, 256))]
    check_shapes(spec, config, good)
    with pytest.raises(InputError, match=r"k_proj.weight': expected shape \[256, 256\] .* found \[128, "):
        check_shapes(spec, config, [("model.layers.0.self_attn.k_proj.weight", (128, 256))])


def test_wrong_rank_and_bias_named() -> None:
    spec = next(s for s in ARCH_SPECS if s.name == "qwen2")
    config = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    with pytest.raises(InputError, match=r"3 dimensions instead of 2"):
        check_shapes(spec, config, [("model.embed_tokens.weight", (512, 256, 1))])
    with pytest.raises(InputError, match=r"k_proj.bias': expected shape \[128\] .* found \[256\]"):
        check_shapes(spec, config, [("model.layers.0.self_attn.k_proj.bias", (256,))])


def test_hostile_layer_index_is_cheap_and_refused() -> None:
    spec = ARCH_SPECS[0]
    name = "model.layers.99999999999999999999.input_layernorm.weight"
    with pytest.raises(InputError, match=r"belongs to layer 99999999999999999999, but config.json"):
        check_shapes(spec, {"num_hidden_layers": 2}, [(name, (8,))])
