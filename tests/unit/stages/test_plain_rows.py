"""Decompose stores plain-type tensors a block of rows at a time: the same bytes and figures as whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.stages.conversion import shard
from pipeline.ternary.pack import decode_bytes, encode_plain


@pytest.mark.parametrize(("ggml_type", "weighted"), [("F16", False), ("Q8_0", False), ("Q4_K", True)])
def test_row_blocks_give_the_whole_tensors_bytes_and_errors(monkeypatch: pytest.MonkeyPatch, ggml_type: str,
                                                            weighted: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 512, generator=gen).to(torch.bfloat16)  # stored 16-bit, as a source hands it
    importance = torch.rand(512, generator=gen).numpy() if weighted else None
    monkeypatch.setattr(shard, "rows_per_block", lambda cols: 5)  # 8 blocks, the last one short
    raw, sq_error, sq_norm, exact = shard._encode_plain_rows(weight, ggml_type, importance)
    w32 = weight.to(torch.float32)
    whole = encode_plain(w32, ggml_type, importance)
    back = torch.from_numpy(decode_bytes(whole, ggml_type, (37, 512)))
    assert np.array_equal(raw, whole)
    assert sq_error == pytest.approx(float(((w32 - back) ** 2).sum(dtype=torch.float64)), rel=1e-9)
    assert sq_norm == pytest.approx(float((w32 * w32).sum(dtype=torch.float64)), rel=1e-9)
    assert exact is bool(torch.equal(w32, back))
    if ggml_type != "F16":
        assert not exact  # the quants round: never exact on random weights


def test_a_norm_is_one_row() -> None:
    norm = torch.randn(512, generator=torch.Generator().manual_seed(4))
    raw, sq_error, sq_norm, exact = shard._encode_plain_rows(norm, "F32", None)
    assert np.array_equal(raw, encode_plain(norm, "F32")) and exact and sq_error == 0.0
    assert sq_norm == pytest.approx(float((norm * norm).sum(dtype=torch.float64)), rel=1e-12)
