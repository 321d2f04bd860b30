"""How many of a GGUF's layers llama.cpp offloads to the GPU: what the device's free memory holds.

The probe's ``n_gpu_layers`` option is a count (``-1``: all, ``0``: none) or `AUTO_LAYERS`, the
default: all layers when the file fits in the GPU's free memory (less a reserve for llama.cpp's
context and buffers), else as many blocks as fit, each taken as an equal share of the file; none
when this llama.cpp build has no GPU backend or no CUDA device is visible. A CPU-only worker
therefore runs as before.

Example::

    offload = choose_offload(Path("model.gguf"), AUTO_LAYERS)
    offload.n_gpu_layers, offload.why   # (0, "no CUDA device is visible") on a CPU machine
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["AUTO_LAYERS", "Offload", "offload_layers", "choose_offload"]

AUTO_LAYERS = -2
_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class Offload:
    n_gpu_layers: int
    why: str


def offload_layers(free_bytes: int, file_bytes: int, n_layers: int,
                   reserve_bytes: int = _RESERVE_BYTES) -> int:
    """-1 when a file of ``file_bytes`` fits in ``free_bytes`` less the reserve, else the number of its
    ``n_layers`` blocks that do (the embedding and head counted as one block more), at least 0."""
    budget = free_bytes - reserve_bytes
    if n_layers <= 0 or budget <= 0:
        return 0
    if file_bytes <= budget:
        return -1
    per_layer = file_bytes / (n_layers + 1)
    return max(0, min(n_layers, int(budget // per_layer)))


def choose_offload(path: Path, requested: int) -> Offload:
    """The layer count for ``path``: ``requested`` unless it is `AUTO_LAYERS` (see the module docstring)."""
    if requested != AUTO_LAYERS:
        return Offload(requested, "as asked (n_gpu_layers option)")
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        return Offload(0, "this llama.cpp build has no GPU backend")
    free = _cuda_free_bytes()
    if free is None:
        return Offload(0, "no CUDA device is visible")
    n_layers = _block_count(path)
    layers = offload_layers(free, path.stat().st_size, n_layers)
    shown = "all" if layers == -1 else f"{layers} of {n_layers}"
    size = path.stat().st_size
    return Offload(layers, f"{shown} layers: {free / 1e9:.1f} GB free on the GPU, the file is "
                           f"{size / 1e9:.2f} GB, {_RESERVE_BYTES >> 20} MB kept for llama.cpp")


def _cuda_free_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def _block_count(path: Path) -> int:
    from pipeline.formats.gguf.reader import GGUFFile

    gguf = GGUFFile(path)
    arch = gguf.get_field("general.architecture")
    count = gguf.get_field(f"{arch.contents()}.block_count") if arch is not None else None
    return int(count.contents()) if count is not None else 0
