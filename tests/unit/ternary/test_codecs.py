"""The codec registry: one codec per low-bit type, each round-tripping its own layout."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.formats.gguf.types import block_geometry
from pipeline.ternary import decompose
from pipeline.ternary.codecs import CODECS, codec_for
from pipeline.ternary.policy import METHODS


def test_every_fitted_type_has_one_codec_with_the_types_geometry() -> None:
    assert list(CODECS) == ["TQ2_0", "TQ1_0", "Q2_0", "Q1_0"]
    for name, codec in CODECS.items():
        assert codec.name == name and (codec.block_size, codec.type_size) == block_geometry(name)
    with pytest.raises(ValueError, match="'Q4_K' is not a ternary type; expected one of TQ2_0, TQ1_0, Q2_0"):
        codec_for("Q4_K")


@pytest.mark.parametrize("name", list(CODECS))
def test_pack_unpack_round_trip_and_dequantize(name: str) -> None:
    codec = CODECS[name]
    low, high = codec.code_range
    rng = np.random.default_rng(7)
    codes = rng.integers(low, high + 1, size=(5, codec.block_size)).astype(np.int8)
    if name == "Q1_0":
        codes[codes == 0] = 1
    scales = np.array([0.5, -1.25, 3.0, 0.0, 1e-3], np.float32).astype(np.float16).astype(np.float32)
    raw = codec.pack(codes, scales)
    assert raw.size == 5 * codec.type_size
    back, back_scales = codec.unpack(raw)
    assert np.array_equal(back, codes) and np.array_equal(back_scales, scales)
    assert np.array_equal(codec.dequantize(raw), (codes * scales[:, None]).reshape(-1))
    blocks = codec.blocks(raw)
    assert np.array_equal(codec.assemble(codec.raw_codes(blocks), codec.scale_bytes(blocks)), raw)
    with pytest.raises(ValueError, match=f"not whole {name} blocks"):
        codec.unpack(raw[:-1])


def test_the_tq_torch_fits_are_the_methods_the_codecs_declare() -> None:
    assert decompose.METHODS == codec_for("TQ2_0").methods == codec_for("TQ1_0").methods
    assert set(METHODS) == {m for codec in CODECS.values() for m in codec.methods} | {"gptq"}
