"""llama.cpp's own quantizer for the legacy and K-quant types, called on one tensor at a time.

``ggml_quantize_chunk`` (libggml-base, shipped with llama-cpp-python) is the function
``llama_model_quantize`` calls for every tensor it converts (src/llama-quant.cpp): the same
rounding, the same importance-matrix weighting. Calling it per tensor lets a recipe give each
tensor its own type while ternary tensors fitted by this project keep their bytes.

Example::

    raw = quantize(weights_f32, "Q4_K", importance=imatrix_column_means)   # uint8, GGUF-ready
"""

from __future__ import annotations

import ctypes
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.core.errors import IntegrityError
from pipeline.formats.gguf.types import GGMLTypeName, block_geometry, ggml_type

__all__ = ["LLAMA_QUANT_TYPES", "quantize", "llama_cpp_library_file"]

# Types this module makes with llama.cpp's quantizer (none of them needs an importance matrix;
# each takes one to weight its rounding).
LLAMA_QUANT_TYPES = (
    GGMLTypeName.Q4_0, GGMLTypeName.Q5_0, GGMLTypeName.Q2_K, GGMLTypeName.Q3_K, GGMLTypeName.Q4_K,
    GGMLTypeName.Q5_K, GGMLTypeName.Q6_K,
)


def llama_cpp_library_file(base: str) -> Path:
    """The shared library ``base`` (e.g. ``ggml-base``) that llama-cpp-python ships; IntegrityError
    when it is not there."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    names = {"darwin": [f"lib{base}.dylib"], "win32": [f"{base}.dll", f"lib{base}.dll"]}
    for name in names.get(sys.platform, [f"lib{base}.so"]):
        if (folder / name).exists():
            return folder / name
    raise IntegrityError(f"llama-cpp-python's {base} library is not in {folder}; reinstall llama-cpp-python")


@lru_cache(maxsize=1)
def _library() -> Any:
    lib = ctypes.CDLL(str(llama_cpp_library_file("ggml-base")))
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def quantize(
    values: npt.ArrayLike, type_name: str, importance: npt.ArrayLike | None = None
) -> npt.NDArray[np.uint8]:
    """Rows of ``values`` (2-D ``[rows, cols]``, or 1-D as one row) in ``type_name``, flattened bytes.

    ``importance``: one non-negative weight per column (an imatrix entry), or None. Raises
    ValueError for a type this module does not make, a row length that does not fit the type's
    blocks, or an importance of the wrong length; IntegrityError when the library disagrees with
    gguf's block sizes (another llama.cpp than the one this was written for).
    """
    if type_name not in LLAMA_QUANT_TYPES:
        raise ValueError(
            f"{type_name!r} is not made by llama.cpp's quantizer here; "
            f"expected one of {', '.join(LLAMA_QUANT_TYPES)}"
        )
    rows_in = np.ascontiguousarray(values, dtype=np.float32)
    rows = rows_in.reshape(1, -1) if rows_in.ndim == 1 else rows_in.reshape(-1, rows_in.shape[-1])
    n_rows, n_cols = rows.shape
    block, block_bytes = block_geometry(type_name)
    if n_cols % block:
        raise ValueError(f"row length {n_cols} is not a multiple of the {type_name} block size {block}")
    weights = None
    if importance is not None:
        weights = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
        if weights.size != n_cols:
            raise ValueError(f"importance has {weights.size} entries for rows of {n_cols}")
    lib, type_id = _library(), int(ggml_type(type_name))
    row_bytes = n_cols // block * block_bytes
    if int(lib.ggml_row_size(type_id, n_cols)) != row_bytes:
        raise IntegrityError(
            f"llama.cpp's {type_name} row of {n_cols} is {lib.ggml_row_size(type_id, n_cols)} "
            f"bytes, gguf says {row_bytes}: the installed llama-cpp-python does not match"
        )
    out = np.empty(n_rows * row_bytes, np.uint8)
    lib.ggml_quantize_init(type_id)
    written = int(
        lib.ggml_quantize_chunk(
            type_id,
            rows.ctypes.data,
            out.ctypes.data,
            0,
            n_rows,
            n_cols,
            weights.ctypes.data if weights is not None else None,
        )
    )
    if written != out.size:
        raise IntegrityError(
            f"llama.cpp's quantizer wrote {written} bytes of {type_name}, expected {out.size}"
        )
    return out
