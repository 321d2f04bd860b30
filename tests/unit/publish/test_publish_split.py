"""llama.cpp split planning and size parsing (pure; llama.cpp loads a split set in test_publish.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeline.core.errors import InputError
from pipeline.formats.gguf.split import parse_size, plan_splits, split_name


@dataclass
class _Tensor:
    name: str
    n_bytes: int


def test_sizes_are_decimal_like_llama_gguf_split() -> None:
    assert parse_size("2G") == 2_000_000_000
    assert parse_size("500M") == 500_000_000
    assert parse_size("300k") == 300_000
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("123456") == 123_456
    for bad in ("", "0", "-1G", "two gigs", "5X"):
        with pytest.raises(InputError, match="not a positive size"):
            parse_size(bad)


def test_split_names_are_llama_cpps() -> None:
    assert split_name("model", 0, 3) == "model-00001-of-00003.gguf"
    assert split_name("model", 2, 3) == "model-00003-of-00003.gguf"


def test_tensors_keep_their_order_and_padded_sizes_decide_the_cut() -> None:
    tensors = [_Tensor(f"t{i}", size) for i, size in enumerate([100, 100, 90, 500, 10])]
    # 100 and 100 pad to 128 each (256); adding 90 (96) would make 352 > 300.
    groups = plan_splits(tensors, 300)  # type: ignore[arg-type]
    assert [[t.name for t in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert plan_splits(tensors, 10_000) == [tensors]  # type: ignore[arg-type]
