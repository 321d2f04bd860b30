"""The error-compensating fit (``method=gptq``) of one weight matrix, packed into its ggml block type.

`gptq.gptq_fit` chooses codes and scales against the layer's input Gram matrix ``XᵀX`` (collected by
the calibrate stage); this module packs them as TQ2_0, TQ1_0, Q2_0 (3 or 4 levels) or Q1_0 bytes and
states the same figures as every other fit (`packed.PackedMatrix`): the weight-space relative error
of the result, and that of the absmean baseline of the same layout, so reports stay comparable. The
fit minimises the *output* error instead, which is why its weight-space error can be the larger.

Example::

    packed = decompose_gptq_packed(weight, "TQ2_0", gram)
    packed.raw          # uint8 bytes of a TQ2_0 tensor
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.gptq import LAYOUTS, dequantize, gptq_fit
from pipeline.ternary.packed import PackedMatrix
from pipeline.ternary.rows import ratio

__all__ = ["decompose_gptq_packed", "layout_name"]


def layout_name(ggml_type: str, levels: int = 3) -> str:
    """The `gptq.LAYOUTS` key of a block type (Q2_0 with 4 levels has its own code set)."""
    if ggml_type == GGMLTypeName.Q2_0 and levels == 4:
        return "Q2_0_4LEVEL"
    if ggml_type not in LAYOUTS:
        raise ValueError(f"{ggml_type!r} has no error-compensating fit; "
                         "expected one of TQ2_0, TQ1_0, Q2_0, Q1_0")
    return ggml_type


def _baseline_sq_error(w: torch.Tensor, ggml_type: str, block_size: int) -> float:
    from pipeline.ternary.codecs import codec_for

    blocks = w.reshape(-1, block_size)
    codes, scales = codec_for(ggml_type).baseline(blocks)
    approx = codes.to(torch.float64) * scales.to(torch.float64)[:, None]
    return float(((blocks.double() - approx) ** 2).sum())


def decompose_gptq_packed(
    w: torch.Tensor,
    ggml_type: str,
    gram: torch.Tensor,
    levels: int = 3,
    device: torch.device | str | None = None,
    out: npt.NDArray[np.uint8] | None = None,
) -> PackedMatrix:
    """Fit ``w`` [rows, cols] against ``gram`` [cols, cols] and pack it as ``ggml_type``.

    ``device``: where the fit runs (default: ``w``'s). ``out``: optional reused uint8 buffer.
    Raises ValueError for a type without this fit or shapes that do not fit its blocks.
    """
    from pipeline.ternary.codecs import codec_for

    layout = LAYOUTS[layout_name(ggml_type, levels)]
    if w.dim() != 2:
        raise ValueError(f"the gptq fit needs a 2-D weight, got shape {tuple(w.shape)}")
    dev = torch.device(device) if device is not None else w.device
    weight = w.to(dev, torch.float32)
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("the weight holds non-finite values")
    fit = gptq_fit(weight, gram.to(dev), layout)
    codes, scales = fit.codes.cpu(), fit.scales.cpu()
    raw = codec_for(ggml_type).pack(codes, scales.reshape(-1))
    exact = weight.cpu().double()
    approx = dequantize(codes, scales, layout.block_size).double()
    sq_error = float(((exact - approx) ** 2).sum())
    sq_norm = float((exact * exact).sum())
    absmean_sq = _baseline_sq_error(weight.cpu(), ggml_type, layout.block_size)
    if out is not None and out.size >= raw.size:
        out[: raw.size] = raw
        raw = out[: raw.size]
    n_zero = int((codes == 0).sum())
    return PackedMatrix(
        raw=raw, ggml_type=ggml_type, method="gptq", backend=f"torch ({dev.type})",
        rel_error=ratio(sq_error, sq_norm), absmean_rel_error=ratio(absmean_sq, sq_norm),
        sparsity=n_zero / max(w.numel(), 1), sq_error=sq_error, absmean_sq_error=absmean_sq,
        sq_norm=sq_norm, n_zero=n_zero,
    )
