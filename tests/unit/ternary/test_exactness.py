"""`ternary.exactness.decodes_exactly`: the compiled TQ2_0 / Q2_0 comparisons and the numpy path agree
with decoding the bytes, and one changed value anywhere is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.ternary.codecs import decompose_packed
from pipeline.ternary.exactness import decodes_exactly
from pipeline.ternary.pack import decode_bytes


def _ternary(rows: int = 32, cols: int = 512, per: int | None = None, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-1, 2, (rows, cols), generator=gen).float()
    groups = cols // (per or cols)
    scales = (torch.rand(rows, groups, generator=gen) * 0.02 + 0.01).half().float()
    return (codes * scales.repeat_interleave(cols // groups, dim=1)).to(torch.bfloat16)


@pytest.mark.parametrize("ggml_type", ["TQ2_0", "Q2_0", "TQ1_0"])
@pytest.mark.parametrize("as_float32", [False, True])
def test_exact_ternary_weights_pass_and_any_change_is_caught(ggml_type: str, as_float32: bool) -> None:
    weight = _ternary()
    source = weight.float() if as_float32 else weight
    raw = decompose_packed(weight, ggml_type, "optimal", device=torch.device("cpu")).raw
    assert decodes_exactly(raw, ggml_type, source)
    assert decodes_exactly(raw, ggml_type, source.float().numpy())
    for row, col in ((0, 0), (31, 511), (7, 300)):
        changed = source.clone()
        changed[row, col] = changed[row, col] + 0.0078125
        assert not decodes_exactly(raw, ggml_type, changed), (row, col)
    flipped = raw.copy()
    flipped[len(flipped) // 2] ^= 0x01
    assert decodes_exactly(flipped, ggml_type, source) == np.array_equal(
        decode_bytes(flipped, ggml_type, tuple(weight.shape)), weight.float().numpy())


def test_negative_zero_equals_zero_and_finer_scales_need_q2_0() -> None:
    weight = _ternary(per=128)
    signed = torch.where(weight == 0, torch.tensor(-0.0, dtype=torch.bfloat16), weight)
    q2 = decompose_packed(weight, "Q2_0", "optimal", device=torch.device("cpu")).raw
    tq2 = decompose_packed(weight, "TQ2_0", "optimal", device=torch.device("cpu")).raw
    assert decodes_exactly(q2, "Q2_0", signed)
    assert not decodes_exactly(tq2, "TQ2_0", weight)
