"""llama.cpp's own block (de)quantizers, called through ctypes: the reference the layout tests use.

``ggml_get_type_traits(type)`` (``ggml/include/ggml.h``) gives each type's ``to_float``
(``dequantize_row_*``) and ``from_float_ref`` (``quantize_row_*_ref``), compiled into the
``libggml-base`` that llama-cpp-python ships. No reimplementation: the bytes and values are
llama.cpp's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["available", "dequantize", "quantize_ref", "type_size"]

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64)


class _Traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", _TO_FLOAT),
        ("from_float_ref", _FROM_FLOAT),
    ]


def _library() -> ctypes.CDLL | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    for path in sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so*")):
        lib = ctypes.CDLL(str(path))
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        return lib
    return None


_LIB = _library()


def available() -> bool:
    """True when llama-cpp-python's libggml-base could be loaded."""
    return _LIB is not None


def _traits(type_id: int) -> _Traits:
    assert _LIB is not None, "llama-cpp-python's libggml-base is not available"
    return _LIB.ggml_get_type_traits(type_id).contents


def type_size(type_id: int) -> tuple[str, int, int]:
    """(name, weights per block, bytes per block) as llama.cpp's type table has them."""
    traits = _traits(type_id)
    return traits.type_name.decode(), int(traits.blck_size), int(traits.type_size)


def dequantize(raw: npt.NDArray[np.uint8], type_id: int, n_values: int) -> npt.NDArray[np.float32]:
    """llama.cpp's ``to_float`` of ``raw`` block bytes: float32 ``[n_values]``."""
    src = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.empty(n_values, np.float32)
    _traits(type_id).to_float(src.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n_values)
    return out


def quantize_ref(values: npt.NDArray[np.float32], type_id: int) -> npt.NDArray[np.uint8]:
    """llama.cpp's ``from_float_ref`` (``quantize_row_*_ref``) of float32 ``values``: block bytes."""
    src = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    _, block, size = type_size(type_id)
    out = np.zeros(src.size // block * size, np.uint8)
    as_floats = src.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    _traits(type_id).from_float_ref(as_floats, out.ctypes.data, src.size)
    return out
