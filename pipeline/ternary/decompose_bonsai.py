"""Matrix-level fits into the Bonsai layouts: a torch ``[rows, cols]`` weight into Q2_0 / Q1_0 bytes.

Blocks run along each row, as in `decompose`. On the CPU the optimal fit (any level count,
with or without importance) runs in the compiled kernel (`kernel_bonsai`), one pass per block;
elsewhere (CUDA, the llama.cpp reference rules, no numba) through `fit_bonsai` in row chunks and
`pack_bonsai`. Both give the same bytes.

Methods: ``optimal`` (the exact fit of `fit_bonsai`), ``absmax`` (Q2_0: llama.cpp's own
``quantize_row_q2_0_ref``), ``absmean`` (Q2_0: BitNet-style ``d`` = mean|w|, ternary levels;
Q1_0: llama.cpp's ``quantize_row_q1_0_ref``, the same rule). The report's baseline
("absmean") is the absmean fit of the same layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from pipeline.formats.gguf.types import BONSAI_TYPES
from pipeline.ternary import fit_bonsai, pack_bonsai
from pipeline.ternary.fit import block_sq_error, fit_absmean
from pipeline.ternary.policy import BONSAI_METHODS as METHODS

if TYPE_CHECKING:
    from pipeline.ternary.packed import PackedMatrix

__all__ = ["METHODS", "decompose_bonsai_packed"]

_TARGET_CHUNK_WEIGHTS = 1 << 22


def _fit(blocks: torch.Tensor, ggml_type: str, method: str, levels: int,
         importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if ggml_type == "Q1_0":
        if method == "optimal":
            return fit_bonsai.fit_q1_0(blocks, importance)
        return fit_bonsai.fit_q1_0_absmean(blocks)
    if method == "optimal":
        return fit_bonsai.fit_q2_0(blocks, importance, levels)
    if method == "absmax":
        return fit_bonsai.fit_q2_0_absmax(blocks)
    return fit_absmean(blocks)


def _baseline(blocks: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    return fit_bonsai.fit_q1_0_absmean(blocks) if ggml_type == "Q1_0" else fit_absmean(blocks)


def _check(w: torch.Tensor, ggml_type: str, method: str, levels: int) -> int:
    if ggml_type not in METHODS:
        raise ValueError(f"{ggml_type!r} is not a Bonsai type; expected one of {sorted(METHODS)}")
    if method not in METHODS[ggml_type]:
        raise ValueError(f"method {method!r} does not apply to {ggml_type}; expected one of "
                         f"{', '.join(METHODS[ggml_type])}")
    if levels not in fit_bonsai.LEVELS or (ggml_type == "Q1_0" and levels != 3):
        raise ValueError(f"levels={levels!r}; Q2_0 takes 3 or 4 and Q1_0 has no levels option")
    if w.dim() != 2:
        raise ValueError(f"a {ggml_type} fit needs a 2-D weight, got shape {tuple(w.shape)}")
    block_size = BONSAI_TYPES[ggml_type].block_size
    if w.shape[1] % block_size:
        raise ValueError(f"row length {w.shape[1]} is not a multiple of the {ggml_type} block size "
                         f"{block_size}")
    return block_size


def _uses_kernel(w: torch.Tensor, method: str, device: torch.device | str | None) -> bool:
    from pipeline.ternary import kernel

    on_cpu = w.device.type == "cpu" and (device is None or torch.device(device).type == "cpu")
    return method == "optimal" and on_cpu and kernel.is_available()


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float((num / den) ** 0.5)


def decompose_bonsai_packed(
    w: torch.Tensor,
    ggml_type: str,
    method: str = "optimal",
    levels: int = 3,
    importance: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    out: npt.NDArray[np.uint8] | None = None,
) -> PackedMatrix:
    """Fit every block of each row of ``w`` ``[rows, cols]`` and pack it as ``ggml_type`` (Q2_0 or Q1_0).

    ``importance``: optional non-negative ``[cols]`` (optimal fit only; the reported errors are
    unweighted). ``levels``: 3 or 4 (Q2_0). ``device``: where the torch path runs (default: ``w``'s).
    ``out``: optional reused uint8 buffer. Raises ValueError for an unknown type or method, a
    bad ``levels``, a non-2-D ``w``, a row length that is not whole blocks, or non-finite values.
    """
    from pipeline.ternary import kernel_bonsai
    from pipeline.ternary.packed import PackedMatrix

    block_size = _check(w, ggml_type, method, levels)
    if importance is not None and method != "optimal":
        raise ValueError(f"importance applies to the optimal fit only, not {method!r}")
    if importance is not None and tuple(importance.shape) != (w.shape[1],):
        raise ValueError(f"importance must have shape ({w.shape[1]},), got {tuple(importance.shape)}")
    n_params = w.numel()
    if _uses_kernel(w, method, device):
        w = w.detach().contiguous()
        if w.dtype == torch.bfloat16:  # the kernel widens bfloat16 as it loads: no float32 copy
            blocks = w.view(torch.int16).numpy().view(np.uint16).reshape(-1, block_size)
        else:
            blocks = w.to(torch.float32).numpy().reshape(-1, block_size)
        imp = None if importance is None else importance.detach().to(torch.float32).cpu().numpy()
        raw, stats = kernel_bonsai.fit_pack(blocks, ggml_type, levels, imp, out)
        return PackedMatrix(
            raw=raw, ggml_type=ggml_type, method=method, backend="kernel",
            rel_error=_ratio(stats.sq_error, stats.sq_norm),
            absmean_rel_error=_ratio(stats.absmean_sq_error, stats.sq_norm),
            sparsity=(n_params - stats.n_nonzero) / max(n_params, 1), sq_error=stats.sq_error,
            absmean_sq_error=stats.absmean_sq_error, sq_norm=stats.sq_norm, n_zero=n_params - stats.n_nonzero,
        )
    raw, sq_error, absmean_sq, sq_norm, n_zero = _torch_path(w, ggml_type, method, levels, importance, device)
    if out is not None and out.size >= raw.size:
        out[: raw.size] = raw
        raw = out[: raw.size]
    return PackedMatrix(
        raw=raw, ggml_type=ggml_type, method=method, backend="torch", rel_error=_ratio(sq_error, sq_norm),
        absmean_rel_error=_ratio(absmean_sq, sq_norm), sparsity=n_zero / max(n_params, 1), sq_error=sq_error,
        absmean_sq_error=absmean_sq, sq_norm=sq_norm, n_zero=n_zero,
    )


def _torch_path(
    w: torch.Tensor, ggml_type: str, method: str, levels: int, importance: torch.Tensor | None,
    device: torch.device | str | None,
) -> tuple[npt.NDArray[np.uint8], float, float, float, int]:
    """Row chunks through `fit_bonsai` and `pack_bonsai`: bytes and the float64 error sums."""
    rows, cols = w.shape
    block_size = BONSAI_TYPES[ggml_type].block_size
    dev = torch.device(device) if device is not None else w.device
    pack = pack_bonsai.pack_q1_0 if ggml_type == "Q1_0" else pack_bonsai.pack_q2_0
    step = max(1, _TARGET_CHUNK_WEIGHTS // max(cols, 1))
    imp_row = None
    if importance is not None:
        imp_row = importance.to(dev, torch.float32).reshape(1, cols // block_size, block_size)
    parts: list[npt.NDArray[np.uint8]] = []
    sq_error = absmean_sq = sq_norm = 0.0
    n_zero = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks = w[r0:r1].to(dev, torch.float32).reshape(-1, block_size)
        imp = None if imp_row is None else imp_row.expand(r1 - r0, -1, -1).reshape(-1, block_size)
        codes, scales = _fit(blocks, ggml_type, method, levels, imp)
        base_codes, base_scales = _baseline(blocks, ggml_type)
        exact = blocks.double()
        sq_error += block_sq_error(exact, codes, scales.double()).sum().item()
        absmean_sq += block_sq_error(exact, base_codes, base_scales.double()).sum().item()
        sq_norm += (exact * exact).sum().item()
        n_zero += int((codes == 0).sum().item())
        parts.append(pack(codes.cpu(), scales.cpu()))
    raw = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    return raw, sq_error, absmean_sq, sq_norm, n_zero
