"""The importance matrix in llama.cpp's own imatrix GGUF format, read and written.

The layout ``llama-imatrix`` writes and ``llama-quantize --imatrix`` reads (tools/imatrix,
common/imatrix-loader): per weight two F32 tensors, ``<weight>.in_sum2`` with ggml shape
``[cols, n_mat]`` (the sum of x² over the tokens each matrix saw) and ``<weight>.counts``
``[1, n_mat]`` (those token counts); metadata ``general.type = "imatrix"``,
``imatrix.datasets`` (the calibration texts' names), ``imatrix.chunk_count`` and
``imatrix.chunk_size`` (sequences of that many tokens). Sums, not means: files merge by
adding. llama.cpp's quantizer takes the means, ``in_sum2 / counts`` per matrix (1.0 for a
matrix that saw no token), as a ``llama_model_imatrix_data`` array: `quantizer_imatrix`.

Our writer (`gguf_pack.write.write_gguf`) also records ``general.architecture = "imatrix"``;
llama.cpp's imatrix loader reads only the keys above and ignores it.

Example::

    write_imatrix(workdir / "imatrix.gguf", Imatrix.from_stats(stats, (BUILTIN_NAME,), 512, 9))
    matrix = read_imatrix(workdir / "imatrix.gguf")
    matrix.importance("blk.0.ffn_down.weight")          # float32 [n_mat, cols]
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import numpy.typing as npt

from pipeline.core.errors import InputError, IntegrityError

if TYPE_CHECKING:
    from pipeline.calibration.stats import ActivationStats

__all__ = [
    "IMATRIX_TYPE",
    "Imatrix",
    "write_imatrix",
    "read_imatrix",
    "QuantizerImatrix",
    "quantizer_imatrix",
]

IMATRIX_TYPE = "imatrix"
KEY_TYPE = "general.type"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
_SUM_SUFFIX, _COUNT_SUFFIX = ".in_sum2", ".counts"
_F32 = gguf.GGMLQuantizationType.F32
Sums = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Imatrix:
    """name -> (sums float32 [n_mat, cols], counts float32 [n_mat]) plus the file's metadata."""

    entries: Mapping[str, tuple[Sums, Sums]]
    datasets: tuple[str, ...]
    chunk_count: int
    chunk_size: int

    @classmethod
    def from_stats(
        cls, stats: ActivationStats, datasets: tuple[str, ...], chunk_size: int, chunk_count: int
    ) -> Imatrix:
        """The imatrix of a run over ``chunk_count`` sequences of up to ``chunk_size`` tokens."""
        return cls(stats.sums_and_counts(), datasets, chunk_count, chunk_size)

    def importance(self, name: str) -> Sums:
        """Mean x² per input column, float32 [n_mat, cols]; 1.0 where a matrix saw no token, as llama.cpp."""
        sums, counts = self.entries[name]
        col = counts.astype(np.float64)[:, None]
        means = np.where(col > 0, sums / np.maximum(col, 1.0), 1.0)
        return means.astype(np.float32)


def _check_entry(name: str, sums: Sums, counts: Sums) -> None:
    if sums.ndim != 2 or counts.shape != (sums.shape[0],):
        raise IntegrityError(
            f"imatrix entry {name!r}: sums {sums.shape} and counts {counts.shape} do not pair "
            "(expected [n_mat, cols] and [n_mat])"
        )
    if not (np.all(np.isfinite(sums)) and np.all(np.isfinite(counts))):
        raise IntegrityError(
            f"imatrix entry {name!r} holds non-finite values; llama.cpp's quantizer refuses them"
        )


def _constant(values: Sums) -> Any:
    data = np.ascontiguousarray(values, dtype=np.float32)
    return lambda: data


def write_imatrix(dest: Path, matrix: Imatrix) -> Path:
    """Write ``matrix`` as an imatrix GGUF at ``dest`` (must not exist); tensors in sorted name order
    like llama-imatrix. Raises IntegrityError for an entry whose shapes do not pair or that holds
    NaN/inf, InputError when ``matrix.datasets`` is empty."""
    from pipeline.formats.gguf.writer import TensorToWrite, Typed, write_gguf

    if not matrix.datasets:
        # llama-quantize refuses an imatrix without the key, and gguf-py cannot write an empty array.
        raise InputError(f"{Path(dest).name}: an imatrix needs at least one dataset name (imatrix.datasets)")
    tensors = []
    for name in sorted(matrix.entries):
        sums, counts = matrix.entries[name]
        _check_entry(name, sums, counts)
        n_mat, cols = sums.shape
        # ggml drops trailing dimensions of 1 when it writes a tensor: one matrix is 1-D, as there.
        sum_shape, count_shape = ((cols,), (1,)) if n_mat == 1 else ((n_mat, cols), (n_mat, 1))
        tensors.append(TensorToWrite(name + _SUM_SUFFIX, _F32, sum_shape, _constant(sums)))
        tensors.append(TensorToWrite(name + _COUNT_SUFFIX, _F32, count_shape, _constant(counts)))
    meta = {
        KEY_TYPE: IMATRIX_TYPE,
        KEY_DATASETS: Typed(list(matrix.datasets), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
        KEY_CHUNK_COUNT: Typed(int(matrix.chunk_count), gguf.GGUFValueType.UINT32),
        KEY_CHUNK_SIZE: Typed(int(matrix.chunk_size), gguf.GGUFValueType.UINT32),
    }
    return write_gguf(Path(dest), IMATRIX_TYPE, meta, tensors).path


def read_imatrix(path: Path) -> Imatrix:
    """Read an imatrix GGUF (ours or llama-imatrix's). Raises IntegrityError for a file that is not one:
    no entries, a sum without its count (or the reverse), non-F32 tensors, shapes that do not pair."""
    from pipeline.formats.gguf.reader import GGUFFile

    reader = GGUFFile(path)
    label = Path(path).name
    sums: dict[str, Sums] = {}
    counts: dict[str, Sums] = {}
    for tensor in reader.tensors:
        for suffix, into in ((_SUM_SUFFIX, sums), (_COUNT_SUFFIX, counts)):
            if tensor.name.endswith(suffix):
                if tensor.tensor_type is not _F32:
                    raise IntegrityError(
                        f"{label}: {tensor.name} is {tensor.tensor_type.name}; imatrix tensors are F32"
                    )
                into[tensor.name[: -len(suffix)]] = np.asarray(tensor.data, dtype=np.float32)
    unpaired = sorted(set(sums) ^ set(counts))
    if unpaired:
        raise IntegrityError(f"{label}: imatrix entries without both sums and counts: {unpaired[:5]}")
    if not sums:
        raise IntegrityError(f"{label}: no imatrix entries (<weight>.in_sum2 / <weight>.counts tensors)")
    entries = {}
    for name in sorted(sums):
        n_mat = counts[name].size
        if n_mat == 0 or sums[name].size % n_mat:
            raise IntegrityError(
                f"{label}: {name}: {sums[name].size} sums do not split into {n_mat} matrices"
            )
        entry = (sums[name].reshape(n_mat, -1), counts[name].reshape(-1))
        _check_entry(name, *entry)
        entries[name] = entry

    def value(key: str, default: Any) -> Any:
        field = reader.get_field(key)
        return field.contents() if field is not None else default

    return Imatrix(
        entries,
        tuple(str(d) for d in value(KEY_DATASETS, [])),
        int(value(KEY_CHUNK_COUNT, 0)),
        int(value(KEY_CHUNK_SIZE, 0)),
    )


class QuantizerImatrix:
    """A NULL-terminated ``llama_model_imatrix_data`` array for ``llama_model_quantize_params.imatrix``.

    Holds the float arrays it points into: keep this object alive until the quantizer returns.
    """

    def __init__(self, matrix: Imatrix) -> None:
        from llama_cpp import llama_cpp as lib

        names = sorted(matrix.entries)
        self._names = [n.encode("utf-8") for n in names]
        self._values = [
            np.ascontiguousarray(matrix.importance(n).reshape(-1), dtype=np.float32) for n in names
        ]
        self.array = (lib.llama_model_imatrix_data * (len(names) + 1))()
        for item, name, values in zip(self.array, self._names, self._values, strict=False):
            item.name = name
            item.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            item.size = values.size
        self.array[len(names)].name = None  # the terminator llama.cpp stops at

    @property
    def pointer(self) -> Any:
        """The array as ``POINTER(llama_model_imatrix_data)``."""
        from llama_cpp import llama_cpp as lib

        return ctypes.cast(self.array, ctypes.POINTER(lib.llama_model_imatrix_data))


def quantizer_imatrix(matrix: Imatrix) -> QuantizerImatrix:
    """The importance means of ``matrix`` as llama.cpp's quantizer takes them (see `QuantizerImatrix`)."""
    return QuantizerImatrix(matrix)
