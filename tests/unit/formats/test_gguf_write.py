"""Streaming GGUF writer and the read-back checks in gguf_pack.inspect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.gguf.readback import inspect_gguf, read_metadata
from pipeline.formats.gguf.writer import (
    TensorToWrite,
    Typed,
    file_type_for,
    llama_metadata,
    tensor_nbytes,
    write_gguf,
)

Q = gguf.GGMLQuantizationType


def _ternary(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(-1, 2, size=(rows, cols)) * 0.125).astype(np.float32)


def _tensors(calls: list[str] | None = None) -> list[TensorToWrite]:
    weight = _ternary(4, 512, 0)
    norm = np.linspace(0.5, 1.5, 256, dtype=np.float32)

    def loader(name: str, data: np.ndarray) -> Any:
        def load() -> np.ndarray:
            if calls is not None:
                calls.append(name)
            return data

        return load

    return [
        TensorToWrite(
            "blk.0.attn_q.weight", Q.TQ2_0, (4, 512), loader("q", gguf.quants.quantize(weight, Q.TQ2_0))
        ),
        TensorToWrite("output_norm.weight", Q.F32, (256,), loader("norm", norm)),
        TensorToWrite("token_embd.weight", Q.F16, (2, 256), loader("embd", np.ones((2, 256), np.float16))),
    ]


def _meta() -> dict[str, Any]:
    return {
        "general.name": "t",
        "x.count": 3,
        "x.ratio": 0.5,
        "x.flag": True,
        "x.list": ["a", "b"],
        "x.ids": [1, 2, 3],
        "x.big": Typed(2**40, gguf.GGUFValueType.UINT64),
    }


def test_round_trip_types_shapes_and_values(tmp_path: Path) -> None:
    calls: list[str] = []
    written = write_gguf(tmp_path / "m.gguf", "llama", _meta(), _tensors(calls))
    assert calls == ["q", "norm", "embd"]
    assert written.types == {"F16": 1, "F32": 1, "TQ2_0": 1} and written.tensor_count == 3
    summary = inspect_gguf(
        written.path,
        {
            "blk.0.attn_q.weight": (Q.TQ2_0, (4, 512)),
            "output_norm.weight": (Q.F32, (256,)),
            "token_embd.weight": (Q.F16, (2, 256)),
        },
    )
    assert summary.architecture == "llama" and summary.size_bytes == written.size_bytes
    assert summary.n_params == 4 * 512 + 256 + 512
    assert summary.tensor_bytes == 8 * 66 + 256 * 4 + 512 * 2
    assert summary.bits_per_weight == pytest.approx(8 * summary.tensor_bytes / summary.n_params)
    values = read_metadata(written.path, ("x.count", "x.ratio", "x.flag", "x.list", "x.ids", "x.big", "nope"))
    assert values == {
        "x.count": 3,
        "x.ratio": 0.5,
        "x.flag": True,
        "x.list": ["a", "b"],
        "x.ids": [1, 2, 3],
        "x.big": 2**40,
    }
    reader = gguf.GGUFReader(written.path)
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    restored = gguf.quants.dequantize(np.asarray(q.data), Q.TQ2_0).reshape(4, 512)
    assert np.array_equal(restored, _ternary(4, 512, 0))


def test_same_input_same_bytes(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a.gguf", "llama", _meta(), _tensors())
    b = write_gguf(tmp_path / "b.gguf", "llama", _meta(), _tensors())
    assert a.path.read_bytes() == b.path.read_bytes()


def test_existing_destination_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(InputError, match="already exists"):
        write_gguf(tmp_path / "m.gguf", "llama", {}, _tensors())


def test_short_provider_leaves_nothing(tmp_path: Path) -> None:
    bad = TensorToWrite("output_norm.weight", Q.F32, (256,), lambda: np.zeros(255, np.float32))
    with pytest.raises(IntegrityError, match="output_norm.weight"):
        write_gguf(tmp_path / "m.gguf", "llama", {}, [bad])
    assert list(tmp_path.iterdir()) == []


def test_shape_must_fit_blocks() -> None:
    with pytest.raises(InputError, match="multiple of its block size 256"):
        tensor_nbytes(Q.TQ1_0, (4, 320))
    assert tensor_nbytes(Q.TQ1_0, (4, 512)) == 8 * 54


def test_file_type_follows_lowest_precision() -> None:
    assert file_type_for([Q.F16, Q.TQ2_0, Q.F32]) == gguf.LlamaFileType.MOSTLY_TQ2_0
    assert file_type_for([Q.F16, Q.F32]) == gguf.LlamaFileType.MOSTLY_F16


def test_llama_metadata_from_config(demo_checkpoint: Path) -> None:
    import json

    config = json.loads((demo_checkpoint / "config.json").read_text())
    meta = llama_metadata(config, gguf.LlamaFileType.MOSTLY_TQ2_0)
    assert meta["llama.context_length"] == 256 and meta["llama.feed_forward_length"] == 512
    assert meta["llama.attention.head_count"] == 4 and meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.rope.freq_base"] == 10000.0 and meta["general.file_type"] == 37
    with pytest.raises(InputError, match="rope scaling type .yarn."):
        llama_metadata(
            {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, gguf.LlamaFileType.ALL_F32
        )


def test_inspect_catches_wrong_intent(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", {}, _tensors()).path
    with pytest.raises(IntegrityError, match="intended TQ1_0"):
        inspect_gguf(
            path,
            {
                "blk.0.attn_q.weight": (Q.TQ1_0, (4, 512)),
                "output_norm.weight": (Q.F32, (256,)),
                "token_embd.weight": (Q.F16, (2, 256)),
            },
        )
    with pytest.raises(IntegrityError, match="missing"):
        inspect_gguf(path, {"output_norm.weight": (Q.F32, (256,))} | {"x": (Q.F32, (1,))})


def test_inspect_rejects_truncated_and_hostile_files(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", {}, _tensors()).path
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(IntegrityError):
        inspect_gguf(cut)
    hostile = tmp_path / "hostile.gguf"
    hostile.write_bytes(data[:8] + (2**40).to_bytes(8, "little") + data[16:64])
    with pytest.raises(IntegrityError, match="more than"):
        inspect_gguf(hostile)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(IntegrityError, match="magic"):
        inspect_gguf(junk)


def test_llama3_rope_factors_blend_low_frequencies() -> None:
    import math

    from pipeline.formats.gguf.writer import llama3_rope_factors

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = {"num_attention_heads": 32, "hidden_size": 2048, "rope_theta": 500000.0, "rope_scaling": scaling}
    factors = llama3_rope_factors(config)
    assert factors is not None and factors.shape == (32,) and factors.dtype == np.float32
    for i, got in enumerate(factors.tolist()):
        wavelen = 2 * math.pi * 500000.0 ** (2 * i / 64)
        if wavelen < 8192 / 4:
            want = 1.0
        elif wavelen > 8192 / 1:
            want = 32.0
        else:
            smooth = (8192 / wavelen - 1.0) / 3.0
            want = 1 / ((1 - smooth) / 32.0 + smooth)
        assert got == pytest.approx(want, rel=1e-6), i
    assert llama3_rope_factors({**config, "rope_scaling": None}) is None
    meta = llama_metadata(
        {
            **config,
            "vocab_size": 8,
            "max_position_embeddings": 8,
            "num_hidden_layers": 1,
            "intermediate_size": 8,
        },
        gguf.LlamaFileType.ALL_F32,
    )
    assert "llama.rope.scaling.type" not in meta
