"""What every low-bit codec shares: the checks, the compiled kernel's call, and the choice of path.

A codec is one ggml type (gguf-py's ``quants.py`` is the model: one base, one class per type,
registered by type). It packs codes and scales into the type's llama.cpp blocks and back, and
fits a torch weight matrix straight to those bytes: through the compiled CPU kernel where that
serves, else through the torch fit in row chunks. Both give the same bytes and statistics.
Subclasses give the layout, the torch path and the kernel entry; the argument checks, the
kernel's buffers and totals, and the routing between the two paths live here once.

Nothing here loads torch or numba: the packers run in stages that never fit anything.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from pipeline.formats.gguf.types import block_geometry
from pipeline.ternary.kernel import KernelStats, is_available
from pipeline.ternary.packed import PackedMatrix
from pipeline.ternary.rows import ratio

if TYPE_CHECKING:
    import torch

__all__ = ["Codec", "TorchFit", "as_numpy", "U8Array"]

U8Array = npt.NDArray[np.uint8]
# The torch path's result: bytes, squared error, the absmean baseline's squared error, sum w^2, zeros.
TorchFit = tuple[U8Array, float, float, float, int]


def as_numpy(values: npt.ArrayLike | torch.Tensor, *, float32: bool = False) -> npt.NDArray[np.generic]:
    """A torch tensor (floating ones as float32 when ``float32``) or anything array-like as numpy.
    A value cannot be a tensor unless torch is loaded, so the packers never load it."""
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(values, torch_module.Tensor):
        tensor = values.detach()
        if float32 and tensor.is_floating_point():
            tensor = tensor.to(torch_module.float32)
        return np.asarray(tensor.cpu().numpy())
    return np.asarray(values)


def fp16_scale_bytes(scales: npt.ArrayLike | torch.Tensor, n_blocks: int) -> U8Array:
    """Scales as little-endian fp16 bytes ``[n_blocks, 2]``; ValueError unless finite in fp16."""
    s = as_numpy(scales).reshape(-1)
    if s.shape[0] != n_blocks:
        raise ValueError(f"{n_blocks} blocks of codes but {s.shape[0]} scales")
    with np.errstate(over="ignore", invalid="ignore"):
        s16 = s.astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise ValueError("a scale is not finite in fp16 (|d| > 65504 or NaN)")
    return s16.astype("<f2").view(np.uint8).reshape(-1, 2)


def fp16_scales(scale_bytes: U8Array) -> npt.NDArray[np.float32]:
    """float32 values of little-endian fp16 bytes ``[n_blocks, 2]``."""
    return scale_bytes.copy().view("<f2").astype(np.float32).reshape(-1)


class Codec(ABC):
    """One low-bit ggml type: its llama.cpp block layout, its fits, and its compiled kernel."""

    name: ClassVar[str]
    methods: ClassVar[tuple[str, ...]]  # the per-block fits, "optimal" (the exact fit) first
    levels: ClassVar[tuple[int, ...]] = (3,)  # level counts the fit takes (Q2_0 adds 4)
    kernel_importance: ClassVar[bool] = True  # whether the kernel takes an importance vector
    irls: ClassVar[bool] = False  # whether IRLS refinement applies (the Q fits are exact: no)
    chunk_blocks: ClassVar[int]  # blocks per parallel work item of the kernel
    compile_estimate_s: ClassVar[int]  # the kernel's first compile on a machine, measured on two cores

    def __init__(self) -> None:
        self.block_size, self.type_size = block_geometry(self.name)

    # The layout: a block is raw codes (the unsigned values llama.cpp stores) and one fp16 scale.

    scale_first: ClassVar[bool]  # where a block's fp16 ``d`` sits: first (Q2_0, Q1_0) or last (TQ)
    code_range: ClassVar[tuple[int, int]]  # the codes `pack` takes, lowest and highest
    code_error: ClassVar[str]  # what `pack` says of a code it cannot store

    @abstractmethod
    def raw_codes(self, blocks: U8Array) -> U8Array:
        """The stored codes of ``blocks`` ``[n_blocks, type_size]`` as uint8 ``[n_blocks, block_size]``."""

    @abstractmethod
    def assemble(self, raw_codes: U8Array, scale_bytes: U8Array) -> U8Array:
        """Bytes of stored codes ``[n_blocks, block_size]`` and fp16 scale bytes ``[n_blocks, 2]``."""

    def _to_raw(self, codes: npt.NDArray[np.int16]) -> U8Array:
        return (codes + 1).astype(np.uint8)  # level q is stored as q + 1

    def _from_raw(self, raw_codes: U8Array) -> npt.NDArray[np.int8]:
        return raw_codes.astype(np.int8) - np.int8(1)

    def scale_bytes(self, blocks: U8Array) -> U8Array:
        """The fp16 ``d`` bytes ``[n_blocks, 2]`` of ``blocks`` ``[n_blocks, type_size]``."""
        return blocks[:, :2] if self.scale_first else blocks[:, -2:]

    def pack(self, codes: npt.ArrayLike | torch.Tensor, scales: npt.ArrayLike | torch.Tensor) -> U8Array:
        """Bytes ``[n_blocks * type_size]`` of codes ``[n_blocks, block_size]`` (any whole-block shape)
        and fp16-exact scales ``[n_blocks]`` (others are rounded to nearest). Raises ValueError for a
        code outside `code_range`, a count mismatch or a scale not finite in fp16."""
        c = as_numpy(codes).astype(np.int16).reshape(-1, self.block_size)
        low, high = self.code_range
        if c.size and (c.min() < low or c.max() > high or not self._codes_valid(c)):
            raise ValueError(self.code_error)
        return self.assemble(self._to_raw(c), fp16_scale_bytes(scales, c.shape[0]))

    def _codes_valid(self, codes: npt.NDArray[np.int16]) -> bool:
        return True

    def unpack(self, raw: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
        """Inverse of `pack`: int8 codes ``[n_blocks, block_size]`` and float32 scales ``[n_blocks]``."""
        blocks = self.blocks(raw)
        return self._from_raw(self.raw_codes(blocks)), fp16_scales(self.scale_bytes(blocks))

    def dequantize(self, raw: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """llama.cpp's ``dequantize_row`` for this type: float32 ``code * d`` per weight, flat.

        Exact: a small integer times an fp16 value is a float32 value."""
        codes, scales = self.unpack(raw)
        out: npt.NDArray[np.float32] = (codes.astype(np.float32) * scales[:, None]).reshape(-1)
        return out

    def blocks(self, raw: npt.ArrayLike) -> U8Array:
        """``raw`` as ``[n_blocks, type_size]``; ValueError when it is not whole blocks."""
        data = np.asarray(raw, dtype=np.uint8).reshape(-1)
        if data.size % self.type_size:
            raise ValueError(f"{data.size} bytes are not whole {self.name} blocks of {self.type_size} bytes")
        return data.reshape(-1, self.type_size)

    # The compiled kernel.

    @abstractmethod
    def kernel_entry(self) -> Any:
        """The numba dispatcher of this type's kernel (importing it loads numba)."""

    @abstractmethod
    def _call_kernel(self, src: npt.NDArray[Any], shift: int, imp: npt.NDArray[np.float32], n_per_row: int,
                     view: U8Array, stats: npt.NDArray[np.float64], levels: int) -> None:
        """Run the kernel over every block of ``src`` into ``view``, totals per chunk into ``stats``."""

    def check_levels(self, levels: int) -> None:
        if levels not in self.levels:
            takes = " or ".join(map(str, self.levels))
            raise ValueError(f"levels={levels!r}; {self.name} takes {takes}"
                             + (" (it has no levels option)" if len(self.levels) == 1 else ""))

    def fit_pack(
        self,
        blocks: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
        levels: int = 3,
        importance: npt.NDArray[np.float32] | None = None,
        out: U8Array | None = None,
    ) -> tuple[U8Array, KernelStats]:
        """Fit and pack ``blocks`` ``[n_blocks, block_size]`` (consecutive blocks of whole rows) in one pass.

        ``blocks``: float32, or uint16 holding bfloat16 bit patterns (read as stored, no float32
        copy). ``importance``: optional non-negative float32 ``[cols]``, one value per column of
        the rows the blocks tile, where the kernel takes one. ``out``: optional reused uint8
        buffer of at least ``n_blocks * type_size`` bytes; the returned bytes are a view of it.
        Reported errors are unweighted. Raises ValueError for non-finite weights or importance,
        bad shapes, dtypes or levels, or without numba.
        """
        if not is_available():
            raise ValueError(f"the compiled kernel needs numba; fit {self.name} through the torch path "
                             "(`decompose` with device='cuda', or a method other than optimal)")
        self.check_levels(levels)
        size = self.block_size
        if blocks.dtype not in (np.float32, np.uint16) or blocks.ndim != 2 or blocks.shape[1] != size:
            raise ValueError(f"blocks must be float32 or bfloat16-as-uint16 [n_blocks, {size}], "
                             f"got {blocks.dtype} {blocks.shape}")
        n_blocks = blocks.shape[0]
        imp, n_per_row = self._kernel_importance(importance, n_blocks)
        bf16 = blocks.dtype == np.uint16
        src = np.ascontiguousarray(blocks) if bf16 else np.ascontiguousarray(blocks).view(np.int32)
        n_bytes = n_blocks * self.type_size
        if out is None:
            out = np.empty(n_bytes, np.uint8)
        if out.dtype != np.uint8 or out.ndim != 1 or out.size < n_bytes:
            raise ValueError(f"out must be a 1-D uint8 buffer of at least {n_bytes} bytes")
        view = out[:n_bytes]
        stats = np.zeros((max(1, -(-n_blocks // self.chunk_blocks)), 8))  # 64-byte rows: no false sharing
        if n_blocks:
            import numba

            # Hand the chunks out as threads free up, not in one fixed share per thread: on a machine
            # others share, a thread that loses its core would otherwise hold the whole call up.
            previous = numba.set_parallel_chunksize(1)
            try:
                self._call_kernel(src, 16 if bf16 else 0, imp, n_per_row, view, stats, levels)
            finally:
                numba.set_parallel_chunksize(previous)
        totals = stats.sum(axis=0)
        if totals[4] > 0:
            raise ValueError(f"the weights hold NaN or infinite values ({int(totals[4])} blocks of {size})")
        return view, KernelStats(float(totals[0]), float(totals[1]), float(totals[2]), int(totals[3]))

    def _kernel_importance(
        self, importance: npt.NDArray[np.float32] | None, n_blocks: int
    ) -> tuple[npt.NDArray[np.float32], int]:
        """(importance as contiguous float32, blocks per row); an empty array means uniform."""
        if importance is None:
            return np.empty(0, np.float32), 1
        if not self.kernel_importance:
            raise ValueError(f"the {self.name} kernel fits with uniform importance only; "
                             "weighted fits take the torch path")
        size = self.block_size
        imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
        if imp.size == 0 or imp.size % size:
            raise ValueError(f"importance has {imp.size} values; expected a positive multiple of {size}")
        if not np.all(np.isfinite(imp)) or bool((imp < 0).any()):
            raise ValueError("importance must be finite and non-negative")
        n_per_row = imp.size // size
        if n_blocks % n_per_row:
            raise ValueError(f"{n_blocks} blocks do not tile rows of {imp.size} columns")
        return imp, n_per_row

    # A whole matrix.

    def baseline(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The absmean fit of this layout, the reports' baseline: BitNet's ``d`` = mean |w| on ternary
        levels (Q1_0 overrides it with llama.cpp's own rule)."""
        from pipeline.ternary.fit import fit_absmean

        return fit_absmean(blocks)

    @abstractmethod
    def _torch_fit(self, w: torch.Tensor, method: str, levels: int, importance: torch.Tensor | None,
                   irls_iters: int, device: torch.device | str | None) -> TorchFit:
        """The torch path over row chunks: bytes and the float64 error sums."""

    def _kernel_serves(self, w: torch.Tensor, method: str, importance: torch.Tensor | None, irls_iters: int,
                       device: torch.device | str | None) -> bool:
        import torch

        on_cpu = w.device.type == "cpu" and (device is None or torch.device(device).type == "cpu")
        weighted_ok = importance is None or self.kernel_importance
        return method == "optimal" and irls_iters == 0 and weighted_ok and on_cpu and is_available()

    def _check(self, w: torch.Tensor, method: str, levels: int, importance: torch.Tensor | None,
               irls_iters: int) -> None:
        if method not in self.methods:
            raise ValueError(f"method {method!r} does not apply to {self.name}; expected one of "
                             f"{', '.join(self.methods)}")
        self.check_levels(levels)
        if irls_iters and not self.irls:
            raise ValueError(f"irls_iters={irls_iters} does not apply to {self.name}: its fit is exact")
        if w.dim() != 2:
            raise ValueError(f"a {self.name} fit needs a 2-D weight, got shape {tuple(w.shape)}")
        if w.shape[1] % self.block_size:
            raise ValueError(f"row length {w.shape[1]} is not a multiple of the {self.name} block size "
                             f"{self.block_size}")
        if importance is not None and tuple(importance.shape) != (w.shape[1],):
            raise ValueError(f"importance must have shape ({w.shape[1]},), got {tuple(importance.shape)}")

    def decompose(
        self,
        w: torch.Tensor,
        method: str = "optimal",
        importance: torch.Tensor | None = None,
        irls_iters: int = 0,
        levels: int = 3,
        device: torch.device | str | None = None,
        out: U8Array | None = None,
    ) -> PackedMatrix:
        """Fit every block of each row of ``w`` ``[rows, cols]`` and pack it as this type's bytes.

        ``importance``: optional non-negative ``[cols]``; the fit then minimises the weighted
        error (the reported errors are unweighted). ``device``: where the torch path runs
        (default: ``w``'s; ``w`` may stay memory-mapped on the CPU). ``out``: optional uint8
        buffer reused across calls. On the CPU the optimal fit runs in the compiled kernel
        (bfloat16 weights read as stored); anything else goes through the torch fit. Raises
        ValueError for an unknown method, bad levels or importance, a non-2-D ``w``, rows that
        are not whole blocks, or non-finite weights.
        """
        self._check(w, method, levels, importance, irls_iters)
        n_params = w.numel()
        if self._kernel_serves(w, method, importance, irls_iters, device):
            import torch

            w = w.detach().contiguous()
            if w.dtype == torch.bfloat16:  # the kernel widens bfloat16 as it loads: no float32 copy
                blocks = w.view(torch.int16).numpy().view(np.uint16).reshape(-1, self.block_size)
            else:
                blocks = w.to(torch.float32).numpy().reshape(-1, self.block_size)
            imp = None if importance is None else importance.detach().to(torch.float32).cpu().numpy()
            raw, stats = self.fit_pack(blocks, levels, imp, out)
            return self._packed(raw, method, "kernel", stats.sq_error, stats.absmean_sq_error, stats.sq_norm,
                                n_params - stats.n_nonzero, n_params)
        fitted = self._torch_fit(w, method, levels, importance, irls_iters, device)
        raw, sq_error, absmean_sq, sq_norm, n_zero = fitted
        if out is not None and out.size >= raw.size:
            out[: raw.size] = raw
            raw = out[: raw.size]
        return self._packed(raw, method, "torch", sq_error, absmean_sq, sq_norm, n_zero, n_params)

    def _packed(self, raw: U8Array, method: str, backend: str, sq_error: float, absmean_sq: float,
                sq_norm: float, n_zero: int, n_params: int) -> PackedMatrix:
        return PackedMatrix(
            raw=raw, ggml_type=self.name, method=method, backend=backend, rel_error=ratio(sq_error, sq_norm),
            absmean_rel_error=ratio(absmean_sq, sq_norm), sparsity=n_zero / max(n_params, 1),
            sq_error=sq_error, absmean_sq_error=absmean_sq, sq_norm=sq_norm, n_zero=n_zero,
        )
