"""The Q2_0 and Q1_0 codecs: llama.cpp's sign-and-scale layouts for ternary and binary weights.

- Q2_0 (ggml type 42), 64 weights in 18 bytes: ``d`` (little-endian fp16) first, then
  ``qs[16]``. Element ``j`` is the 2-bit code ``c`` at bits ``2 * (j % 4)`` of ``qs[j // 4]``
  (sequential, not bit planes as in TQ2_0) and decodes to ``(c - 1) * d``: codes 0..3 are
  -1, 0, +1, +2 times ``d``. Here a Q2_0 "code" is that level ``q = c - 1`` in {-1, 0, 1, 2}.
- Q1_0 (ggml type 41), 128 weights in 18 bytes: ``d`` first, then ``qs[16]`` of sign bits.
  Element ``j`` is bit ``j % 8`` of ``qs[j // 8]``: 1 decodes to ``+d``, 0 to ``-d``. Here its
  codes are those signs, -1 or +1.

Scales are any finite fp16 value, negative included (a negative Q2_0 scale mirrors the grid).
Decoding multiplies a small integer by an fp16 value, which float32 holds exactly, so
`dequantize` gives llama.cpp's values bit for bit.

Methods: ``optimal`` (the exact fit of `fit_q`), ``absmax`` (Q2_0: llama.cpp's own
``quantize_row_q2_0_ref``), ``absmean`` (Q2_0: BitNet-style ``d`` = mean|w|, ternary levels;
Q1_0: llama.cpp's ``quantize_row_q1_0_ref``, the same rule). The report's baseline
("absmean") is the absmean fit of the same layout.

The compiled kernel (`_kernel_q_impl`) gives the bytes of `fit_q.fit_q2_0` / `fit_q1_0` followed
by the packer, for every level count and with or without importance; the unit tests check that
bit for bit. Q1_0 is one pass. Q2_0 with importance or ``levels=4`` sorts each block (ranks,
64 x 64 comparisons) and walks the same events as `fit_q`, with the same sums in the same order.
Q2_0 ``levels=3`` with uniform importance, the default, avoids the sort:

1. *Chains* (as in the TQ kernel, `codecs.tq`): with ``H(d) = sum max(0, d (2|w| - d))``
   the error reduction at scale ``d`` and ``g(d)`` the mean of ``{|w| > d/2}`` (non-decreasing in ``d``),
   ``H'(d) = 2 N(d/2) (g - d)``. Steps up from mean ``|w|`` and down from max ``|w|``, each
   stopping 1/64 short of the mean's half, certify that ``H`` rises on ``(0, p_lo]`` with slope
   at least ``2 N(d/2) d c`` and falls on ``[p_hi, max|w|]`` as steeply (``c`` = 1/128 after
   float32 rounding of the chain sums), and never rises beyond ``max |w|``.
2. *fp16 slack*. Let ``F*`` be the continuous optimum. If it lies in fp16's normal range, its
   fp16-rounded scale loses at most ``F* 2^-22 <= sum w^2 2^-22``; add a gap ``sum w^2 2^-30``
   (far above float64 rounding) and call the total ``E``. Any candidate that can win (or tie)
   scores at least ``F* - E``. From the slopes, ``H(d) < F* - E`` for ``d < D_lo``
   (``D_lo^2 = p_lo^2 - E / (c N(p_lo/2))``) and for ``d > D_hi = p_hi (1 + 2^-8)`` once
   ``c N(D_hi/2) (D_hi^2 - p_hi^2) > E`` (else no upper bound is used).
3. *Window*. A candidate (the k largest ``|w|``, scale ``d_k``) that keeps some ``|w| <= t_lo``
   with ``t_lo = (D_lo - E / D_lo) / 2``, or drops some ``|w| > t_hi = (D_hi + E / D_lo) / 2``,
   either has ``d_k`` outside ``[D_lo, D_hi]`` (so it scores below ``F* - E``) or loses at least
   ``E`` against re-choosing that weight's level at ``d_k``. So only counts between
   ``#{|w| > t_hi}`` and ``#{|w| > t_lo}`` are scored, in the reference's order and arithmetic:
   the sum of the weights above ``t_hi`` is exact in any order (each is within 2^8 of the
   largest), the few in between are sorted and added one by one.

Blocks outside that regime (max ``|w|`` beyond [2^-60, 2^60], a continuous optimum below fp16's
normal range or above 65504) take the sorting path, which is exact everywhere.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.codecs.base import Codec, TorchFit, U8Array
from pipeline.ternary.rows import rows_per_block

if TYPE_CHECKING:
    import torch

__all__ = ["QCodec", "Q2_0", "Q1_0"]

_Q2_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_Q1_SHIFTS = np.arange(8, dtype=np.uint8)


class QCodec(Codec):
    """What Q2_0 and Q1_0 share: the fp16 scale first, the kernel, and the torch path in row chunks."""

    scale_first: ClassVar[bool] = True
    chunk_blocks: ClassVar[int] = 256  # 64 KB of float32 Q2_0 weights per parallel work item
    compile_estimate_s: ClassVar[int] = 30  # more variants than the TQ kernel

    def kernel_entry(self) -> Any:
        from pipeline.ternary import _kernel_q_impl

        return _kernel_q_impl.fit_pack_all

    def _call_kernel(self, src: npt.NDArray[Any], shift: int, imp: npt.NDArray[np.float32], n_per_row: int,
                     view: U8Array, stats: npt.NDArray[np.float64], levels: int) -> None:
        is_q1 = self.name == GGMLTypeName.Q1_0
        self.kernel_entry()(src, shift, imp, n_per_row, view, stats, self.chunk_blocks, is_q1, levels,
                            self.type_size)

    @abstractmethod
    def _fit(self, blocks: torch.Tensor, method: str, levels: int,
             importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's levels and fp16-exact scales by ``method`` (torch)."""

    def _torch_fit(self, w: torch.Tensor, method: str, levels: int, importance: torch.Tensor | None,
                   irls_iters: int, device: torch.device | str | None) -> TorchFit:
        import torch

        from pipeline.ternary.fit import block_sq_error

        rows, cols = w.shape
        dev = torch.device(device) if device is not None else w.device
        step = rows_per_block(cols)
        imp_row = None
        if importance is not None:
            imp_row = importance.to(dev, torch.float32).reshape(1, cols // self.block_size, self.block_size)
        parts: list[U8Array] = []
        sq_error = absmean_sq = sq_norm = 0.0
        n_zero = 0
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            blocks = w[r0:r1].to(dev, torch.float32).reshape(-1, self.block_size)
            imp = None if imp_row is None else imp_row.expand(r1 - r0, -1, -1).reshape(-1, self.block_size)
            codes, scales = self._fit(blocks, method, levels, imp)
            base_codes, base_scales = self.baseline(blocks)
            exact = blocks.double()
            sq_error += block_sq_error(exact, codes, scales.double()).sum().item()
            absmean_sq += block_sq_error(exact, base_codes, base_scales.double()).sum().item()
            sq_norm += (exact * exact).sum().item()
            n_zero += int((codes == 0).sum().item())
            parts.append(self.pack(codes.cpu(), scales.cpu()))
        raw = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        return raw, sq_error, absmean_sq, sq_norm, n_zero

    def _check(self, w: torch.Tensor, method: str, levels: int, importance: torch.Tensor | None,
               irls_iters: int) -> None:
        super()._check(w, method, levels, importance, irls_iters)
        if importance is not None and method != "optimal":
            raise ValueError(f"importance applies to the optimal fit only, not {method!r}")


class Q2_0(QCodec):
    """64 weights in 18 bytes: levels {-1, 0, +1} (``levels=3``) or {-1, 0, +1, +2}, 2 bits each."""

    name: ClassVar[str] = GGMLTypeName.Q2_0
    methods: ClassVar[tuple[str, ...]] = ("optimal", "absmean", "absmax")
    levels: ClassVar[tuple[int, ...]] = (3, 4)
    code_range: ClassVar[tuple[int, int]] = (-1, 2)
    code_error: ClassVar[str] = "Q2_0 levels must lie in {-1, 0, 1, 2}"

    def raw_codes(self, blocks: U8Array) -> U8Array:
        return ((blocks[:, 2:, None] >> _Q2_SHIFTS) & 3).astype(np.uint8).reshape(-1, self.block_size)

    def assemble(self, raw_codes: U8Array, scale_bytes: U8Array) -> U8Array:
        qs = np.bitwise_or.reduce(raw_codes.reshape(-1, self.block_size // 4, 4) << _Q2_SHIFTS, axis=2)
        return np.concatenate([scale_bytes, qs], axis=1).reshape(-1)

    def _fit(self, blocks: torch.Tensor, method: str, levels: int,
             importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from pipeline.ternary import fit_q
        from pipeline.ternary.fit import fit_absmean

        if method == "optimal":
            return fit_q.fit_q2_0(blocks, importance, levels)
        if method == "absmax":
            return fit_q.fit_q2_0_absmax(blocks)
        return fit_absmean(blocks)



class Q1_0(QCodec):
    """128 weights in 18 bytes: one sign bit each (+d or -d); binary, so no threshold and no absmax."""

    name: ClassVar[str] = GGMLTypeName.Q1_0
    methods: ClassVar[tuple[str, ...]] = ("optimal", "absmean")
    code_range: ClassVar[tuple[int, int]] = (-1, 1)
    code_error: ClassVar[str] = "Q1_0 codes must be -1 or +1"

    def _codes_valid(self, codes: npt.NDArray[np.int16]) -> bool:
        return not bool((codes == 0).any())

    def _to_raw(self, codes: npt.NDArray[np.int16]) -> U8Array:
        return (codes > 0).astype(np.uint8)  # a set bit is +d

    def _from_raw(self, raw_codes: U8Array) -> npt.NDArray[np.int8]:
        return raw_codes.astype(np.int8) * np.int8(2) - np.int8(1)

    def raw_codes(self, blocks: U8Array) -> U8Array:
        return ((blocks[:, 2:, None] >> _Q1_SHIFTS) & 1).astype(np.uint8).reshape(-1, self.block_size)

    def assemble(self, raw_codes: U8Array, scale_bytes: U8Array) -> U8Array:
        qs = np.bitwise_or.reduce(raw_codes.reshape(-1, self.block_size // 8, 8) << _Q1_SHIFTS, axis=2)
        return np.concatenate([scale_bytes, qs], axis=1).reshape(-1)

    def _fit(self, blocks: torch.Tensor, method: str, levels: int,
             importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from pipeline.ternary import fit_q

        if method == "optimal":
            return fit_q.fit_q1_0(blocks, importance)
        return fit_q.fit_q1_0_absmean(blocks)

    def baseline(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from pipeline.ternary import fit_q

        return fit_q.fit_q1_0_absmean(blocks)
