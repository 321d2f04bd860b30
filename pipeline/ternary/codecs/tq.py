"""The TQ2_0 and TQ1_0 codecs: llama.cpp's ternary K-quant layouts (256 weights a block, codes -1/0/+1).

Layouts (``ggml-common.h``; QK_K = 256 weights per block, ``d`` a little-endian fp16):

- TQ2_0 (ggml type 35), 66 bytes: ``qs[64]`` then ``d``. Code ``q = t + 1`` (0, 1, 2) is a
  2-bit field: element ``n`` lives in byte ``32 * (n // 128) + n % 32`` at bit shift
  ``2 * ((n % 128) // 32)`` (bit planes, not sequential).
- TQ1_0 (ggml type 34), 54 bytes: ``qs[48]``, ``qh[4]``, then ``d``. ``qs[0:32]`` packs
  elements 0..159 five per byte (byte ``m`` holds ``m + 32*i``, i = 0..4, the first as the
  most significant trit), ``qs[32:48]`` elements 160..239 likewise with stride 16, ``qh[j]``
  elements ``240 + j + 4*i`` (i = 0..3) with one extra ×3. Each base-3 number ``v < 243`` is
  stored as ``ceil(v * 256 / 243)`` so a trit is read back as ``((byte * 3^i mod 256) * 3) >> 8``.

The compiled kernel (`_kernel_tq_impl`) fits, packs and sums errors in one pass per block. Its
bytes are those of `fit.fit_optimal` (uniform importance) followed by the packer; the unit tests
check that bit for bit. Weighted fits, IRLS and the absmean/absmax rules take the torch path
(`decompose.decompose_matrix`).

Finding the optimal count k without sorting the block. For a scale ``d`` the best codes keep
exactly the weights with ``|w| > d/2``, and the error then falls by ``H(d) = sum_i max(0,
d (2|w_i| - d))``; the optimum ``F* = max_k S_k^2 / k`` (``S_k``: sum of the k largest
``|w|``) is ``max_d H(d)``. ``H'(d) = 2 N(d) (g(d) - d)``, where ``N(d)`` and ``g(d)`` are the
count and mean of ``{|w| > d/2}``, and ``g`` never decreases as ``d`` grows. So if
``p' <= g(p)``, ``H`` rises on ``[p, p']`` (there ``g(d) >= g(p) >= p' > d``), and if
``p' >= g(p)`` it falls on ``[p', p]``. Two chains of such steps, one up from mean ``|w|``
(below which ``H`` rises) and one down from ``max |w|`` (above which it falls), confine every
maximiser to ``[2 t_lo, 2 t_hi]``: an optimal set keeps all weights above ``t_hi`` and none
below ``t_lo``. Three chain steps (vectorised passes; float32 sums, whose rounding the steps
allow for by stopping 4e-5 short) leave ~12 of the 256 weights in between; those are sorted
and every count they allow is scored exactly as the reference scores it: ``S_k`` in float64
(exact, since every term is within a factor 2^21 of ``max |w|``), ``S_k^2 / k`` in float64,
the first maximum. The window is widened by 1e-6 so that counts whose float64 objective is
within rounding of the optimum are scored too.

Reported errors are ``sum w^2 - 2 d S_k + d^2 k`` with exact ``S_k`` and ``d``; where that is
below 1e-6 of ``sum w^2`` (nearly or exactly ternary blocks) they are summed term by term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import GGMLTypeName
from pipeline.ternary.codecs.base import Codec, TorchFit, U8Array

if TYPE_CHECKING:
    import torch

__all__ = ["TQCodec", "TQ2_0", "TQ1_0"]

_QK = 256
_PLANE_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_POW5 = np.array([81, 27, 9, 3, 1], dtype=np.uint16)
_POW4 = np.array([81, 27, 9, 3], dtype=np.uint16)  # qh: the first trit is shifted up one more place
_READ5 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_READ4 = np.array([1, 3, 9, 27], dtype=np.uint8)


class TQCodec(Codec):
    """What TQ2_0 and TQ1_0 share: the fit (optimal, absmean or absmax, optional IRLS) and its kernel."""

    methods: ClassVar[tuple[str, ...]] = ("optimal", "absmean", "absmax")
    kernel_importance: ClassVar[bool] = False
    irls: ClassVar[bool] = True
    chunk_blocks: ClassVar[int] = 64  # ~64 KB of float32 weights per parallel work item
    compile_estimate_s: ClassVar[int] = 15

    def kernel_entry(self) -> Any:
        from pipeline.ternary import _kernel_tq_impl

        return _kernel_tq_impl.fit_pack_all

    def _call_kernel(self, src: npt.NDArray[Any], shift: int, imp: npt.NDArray[np.float32], n_per_row: int,
                     view: U8Array, stats: npt.NDArray[np.float64], levels: int) -> None:
        self.kernel_entry()(src, shift, view, stats, self.chunk_blocks, self.name == GGMLTypeName.TQ1_0)

    def _torch_fit(self, w: torch.Tensor, method: str, levels: int, importance: torch.Tensor | None,
                   irls_iters: int, device: torch.device | str | None) -> TorchFit:
        from pipeline.ternary.decompose import decompose_matrix

        result = decompose_matrix(w, method, importance=importance, irls_iters=irls_iters, device=device)
        raw = self.pack(result.codes, result.scales)
        n_zero = int((result.codes == 0).sum())
        return raw, result.sq_error, result.absmean_sq_error, result.sq_norm, n_zero

    scale_first: ClassVar[bool] = False
    code_range: ClassVar[tuple[int, int]] = (-1, 1)
    code_error: ClassVar[str] = "codes must lie in {-1, 0, +1}"


class TQ2_0(TQCodec):
    name: ClassVar[str] = GGMLTypeName.TQ2_0

    def raw_codes(self, blocks: U8Array) -> U8Array:
        planes = blocks[:, :64].reshape(-1, 2, 1, 32) >> _PLANE_SHIFTS
        return (planes & 3).astype(np.uint8).reshape(-1, _QK)

    def assemble(self, raw_codes: U8Array, scale_bytes: U8Array) -> U8Array:
        qs = np.bitwise_or.reduce(raw_codes.reshape(-1, 2, 4, 32) << _PLANE_SHIFTS, axis=2).reshape(-1, 64)
        return np.concatenate([qs, scale_bytes], axis=1).reshape(-1)


def _base3(q: npt.NDArray[np.uint8], powers: npt.NDArray[np.uint16]) -> npt.NDArray[np.uint8]:
    """Sum over axis -2 of trits × powers, then the ceil(v * 256 / 243) encoding."""
    v = (q.astype(np.uint16) * powers.reshape(-1, 1)).sum(axis=-2, dtype=np.uint16)
    out: npt.NDArray[np.uint8] = ((v * 256 + 242) // 243).astype(np.uint8)
    return out


def _read_trits(b: npt.NDArray[np.uint8], powers: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """llama.cpp's read of encoded bytes ``b`` [n, m]: trit i is ((b * 3^i mod 256) * 3) >> 8,
    as [n, len(powers), m], most significant first."""
    shifted = b[:, None, :] * powers.reshape(1, -1, 1)  # uint8 wrap-around is the mod 256
    return ((shifted.astype(np.uint16) * 3) >> 8).astype(np.uint8)


class TQ1_0(TQCodec):
    name: ClassVar[str] = GGMLTypeName.TQ1_0

    def raw_codes(self, blocks: U8Array) -> U8Array:
        n = blocks.shape[0]
        parts = [
            _read_trits(blocks[:, :32], _READ5).reshape(n, 160),
            _read_trits(blocks[:, 32:48], _READ5).reshape(n, 80),
            _read_trits(blocks[:, 48:52], _READ4).reshape(n, 16),
        ]
        return np.concatenate(parts, axis=1)

    def assemble(self, raw_codes: U8Array, scale_bytes: U8Array) -> U8Array:
        n = raw_codes.shape[0]
        qs0 = _base3(raw_codes[:, :160].reshape(n, 5, 32), _POW5)
        qs1 = _base3(raw_codes[:, 160:240].reshape(n, 5, 16), _POW5)
        qh = _base3(raw_codes[:, 240:].reshape(n, 4, 4), _POW4)
        return np.concatenate([qs0, qs1, qh, scale_bytes], axis=1).reshape(-1)
