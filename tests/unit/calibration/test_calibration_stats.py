"""Activation statistics, Gram files and the imatrix GGUF: exact sums, round trips, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.calibration.gram import GramFile, gram_file_name, write_gram_file
from pipeline.calibration.imatrix import Imatrix, read_imatrix, write_imatrix
from pipeline.calibration.sequences import split_tokens
from pipeline.calibration.stats import ActivationStats
from pipeline.core.errors import InputError, IntegrityError


def _rows(seed: int, n: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, cols)).astype(np.float32))


def test_sums_counts_and_gram_equal_a_direct_computation() -> None:
    stats = ActivationStats(gram_for=lambda name: name.endswith("attn_q.weight"))
    a, b = _rows(0, 7, 5), _rows(1, 11, 5)
    stats.add(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], a)
    stats.add(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], b)
    x = torch.cat([a, b]).double()
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        torch.testing.assert_close(stats[name].sum_sq[0], (x * x).sum(0), rtol=1e-12, atol=0)
        assert int(stats[name].counts[0]) == 18
    gram = stats["blk.0.attn_q.weight"].gram
    assert gram is not None and stats["blk.0.attn_k.weight"].gram is None
    torch.testing.assert_close(gram, x.T @ x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        stats.importance("blk.0.attn_k.weight")[0], ((x * x).sum(0) / 18).numpy(), rtol=1e-6
    )


def test_repeated_rows_reuse_their_increments_and_stay_exact() -> None:
    stats = ActivationStats(gram_for=lambda name: True)
    rows = _rows(2, 9, 4)
    stats.add("blk.1.ffn_gate.weight", rows)
    stats.add("blk.1.ffn_up.weight", rows.clone())  # same values, another object: reused, same result
    torch.testing.assert_close(
        stats["blk.1.ffn_gate.weight"].gram, stats["blk.1.ffn_up.weight"].gram, rtol=0, atol=0
    )
    with pytest.raises(IntegrityError, match="one weight must always see inputs of one width"):
        stats.add("blk.1.ffn_up.weight", _rows(3, 2, 6))


def test_routed_rows_count_per_expert() -> None:
    stats = ActivationStats()
    rows = _rows(4, 6, 3)
    experts = torch.tensor([0, 2, 2, 0, 2, 1])
    stats.add_routed("blk.0.ffn_up_exps.weight", rows, experts, n_expert=4)
    entry = stats["blk.0.ffn_up_exps.weight"]
    assert entry.counts.tolist() == [2, 1, 3, 0]
    x = rows.double()
    torch.testing.assert_close(entry.sum_sq[2], (x[[1, 2, 4]] ** 2).sum(0))
    importance = stats.importance("blk.0.ffn_up_exps.weight")
    assert importance.shape == (4, 3) and np.all(importance[3] == 1.0)  # no tokens: 1.0, as llama.cpp
    with pytest.raises(IntegrityError, match="expert ids outside"):
        stats.add_routed("blk.0.ffn_up_exps.weight", rows, experts + 2, n_expert=4)


def test_gram_file_round_trip_stores_identical_matrices_once(tmp_path: Path) -> None:
    stats = ActivationStats(gram_for=lambda name: True)
    shared, own = _rows(5, 20, 8), _rows(6, 20, 16)
    stats.add(["blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_v.weight"], shared)
    stats.add("blk.3.ffn_down.weight", own)
    names = stats.names()
    assert {gram_file_name(n) for n in names} == {"blk.3.safetensors"}
    assert gram_file_name("output.weight") == "global.safetensors"
    path = write_gram_file(tmp_path / "gram" / "blk.3.safetensors", stats.take_grams(names))
    assert stats["blk.3.attn_q.weight"].gram is None  # taken: the memory is free
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        assert len(list(handle.keys())) == 2  # q/k/v share one matrix
    gram_file = GramFile(path)
    assert gram_file.names() == sorted(names)
    for name, rows in (("blk.3.attn_v.weight", shared), ("blk.3.ffn_down.weight", own)):
        gram, count = gram_file.read(name)
        x = rows.double()
        torch.testing.assert_close(gram, (x.T @ x).float(), rtol=1e-6, atol=1e-5)
        assert count == 20 and gram.dtype == torch.float32


def test_gram_file_refuses_what_is_not_one(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(2, 2)}, str(path))
    with pytest.raises(IntegrityError, match="no valid bonsai.gram metadata"):
        GramFile(path)


def test_imatrix_round_trip_keeps_sums_counts_and_metadata(tmp_path: Path) -> None:
    stats = ActivationStats()
    stats.add("blk.0.attn_q.weight", _rows(7, 13, 6))
    stats.add_routed("blk.0.ffn_down_exps.weight", _rows(8, 5, 4), torch.tensor([1, 1, 0, 2, 1]), 3)
    matrix = Imatrix.from_stats(stats, ("bonsai-builtin-calibration-v1",), chunk_size=512, chunk_count=4)
    back = read_imatrix(write_imatrix(tmp_path / "imatrix.gguf", matrix))
    assert back.datasets == ("bonsai-builtin-calibration-v1",)
    assert (back.chunk_count, back.chunk_size) == (4, 512)
    assert sorted(back.entries) == sorted(matrix.entries)
    for name, (sums, counts) in matrix.entries.items():
        np.testing.assert_array_equal(back.entries[name][0], sums)
        np.testing.assert_array_equal(back.entries[name][1], counts)
        np.testing.assert_allclose(back.importance(name), stats.importance(name), rtol=1e-6)

    from pipeline.formats.gguf.reader import GGUFFile

    reader = GGUFFile(tmp_path / "imatrix.gguf")
    assert reader.get_field("general.type").contents() == "imatrix"
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    # ggml's own layout: [cols] and [1] for a single matrix, [cols, n_mat] and [1, n_mat] for experts.
    assert shapes["blk.0.attn_q.weight.in_sum2"] == [6] and shapes["blk.0.attn_q.weight.counts"] == [1]
    assert shapes["blk.0.ffn_down_exps.weight.in_sum2"] == [4, 3]
    assert shapes["blk.0.ffn_down_exps.weight.counts"] == [1, 3]


def test_imatrix_refuses_broken_files(tmp_path: Path) -> None:
    import gguf

    from pipeline.formats.gguf.writer import TensorToWrite, write_gguf

    data = np.ones(4, dtype=np.float32)
    path = write_gguf(
        tmp_path / "half.gguf",
        "imatrix",
        {"general.type": "imatrix"},
        [TensorToWrite("blk.0.attn_q.weight.in_sum2", gguf.GGMLQuantizationType.F32, (4,), lambda: data)],
    ).path
    with pytest.raises(IntegrityError, match="without both sums and counts.*attn_q"):
        read_imatrix(path)
    bad = Imatrix({"w": (np.full((1, 2), np.nan, dtype=np.float32), np.ones(1, dtype=np.float32))}, (), 0, 0)
    with pytest.raises(IntegrityError, match="non-finite"):
        write_imatrix(tmp_path / "nan.gguf", Imatrix(bad.entries, ("x",), 0, 0))
    with pytest.raises(InputError, match="at least one dataset name"):
        write_imatrix(tmp_path / "unnamed.gguf", bad)


def test_split_tokens_starts_every_sequence_with_bos() -> None:
    ids = [1, *range(10, 20)]  # BOS then ten tokens
    assert split_tokens(ids, 4, bos=1) == [(1, 10, 11, 12), (1, 13, 14, 15), (1, 16, 17, 18), (1, 19)]
    assert split_tokens(list(range(10, 15)), 2, bos=None) == [
        (10, 11),
        (12, 13),
    ]  # a lone 14 predicts nothing
    with pytest.raises(InputError, match="at least 2"):
        split_tokens(ids, 1, bos=1)
