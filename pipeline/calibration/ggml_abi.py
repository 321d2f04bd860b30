"""ctypes view of ggml's ``struct ggml_tensor`` for the ggml that llama-cpp-python ships.

llama.cpp's eval callback hands over ``struct ggml_tensor *`` pointers; to read a node's op,
its sources and their data this module mirrors the struct (ggml/include/ggml.h of the
vendored ggml, GGML_MAX_DIMS 4, GGML_MAX_SRC 10, GGML_MAX_OP_PARAMS 64, GGML_MAX_NAME 64)
and calls three libggml-base functions (``ggml_backend_buffer_is_host``,
``ggml_backend_tensor_get``, ``ggml_nbytes``) to copy data that lives on a GPU.

A different ggml would silently misread memory, so `ggml_library` checks the mirror against
the library before anything uses it: the struct size must equal ``ggml_tensor_overhead()``
minus ggml's object header, and ``ggml_op_name`` must name the op codes used here.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.core.errors import IntegrityError
from pipeline.formats.gguf.ggml_quantize import llama_cpp_library_file

__all__ = [
    "GGMLTensor",
    "GGML_OP_MUL_MAT",
    "GGML_OP_MUL_MAT_ID",
    "GGML_TYPE_F32",
    "GGML_TYPE_I32",
    "ggml_library",
    "weight_name",
    "tensor_array",
]

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID = 29, 30  # enum ggml_op, counted from GGML_OP_NONE = 0
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
_OBJECT_HEADER_BYTES = 32  # struct ggml_object: offs, size, next, type, padding[4]
_ITEM_BYTES = {GGML_TYPE_F32: 4, GGML_TYPE_I32: 4}
_ITEM_DTYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_I32: np.int32}


class GGMLTensor(ctypes.Structure):
    """``struct ggml_tensor``; ``ne``/``nb`` are sizes and byte strides, fastest dimension first."""


GGMLTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GGMLTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(GGMLTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


@lru_cache(maxsize=1)
def ggml_library() -> Any:
    """libggml-base from llama-cpp-python's folder, its functions typed, the struct mirror checked.

    Raises IntegrityError when the library is absent or its ggml_tensor differs from the mirror
    (llama-cpp-python was upgraded to a ggml this module was not written for).
    """
    import llama_cpp

    lib = ctypes.CDLL(str(llama_cpp_library_file("ggml-base")))
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes = []
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    expected = lib.ggml_tensor_overhead() - _OBJECT_HEADER_BYTES
    names = (lib.ggml_op_name(GGML_OP_MUL_MAT), lib.ggml_op_name(GGML_OP_MUL_MAT_ID))
    if ctypes.sizeof(GGMLTensor) != expected or names != (b"MUL_MAT", b"MUL_MAT_ID"):
        raise IntegrityError(
            f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} ships a ggml whose ggml_tensor "
            f"({expected} bytes, ops {names}) differs from the mirror in {__name__} "
            f"({ctypes.sizeof(GGMLTensor)} bytes, MUL_MAT={GGML_OP_MUL_MAT}); "
            "update the mirror from its ggml.h"
        )
    return lib


def weight_name(raw: bytes) -> str:
    """A weight's own name from a node source's name: ``CUDA0#blk.0.attn_k.weight#0`` -> that weight's.

    The scheduler names a weight's copy on another backend that way.
    """
    name = raw.decode("utf-8", errors="replace")
    if "#" in name:
        name = name.split("#")[1]
    return name


def tensor_array(tensor: GGMLTensor) -> npt.NDArray[Any]:
    """A copy of an F32 or I32 tensor's elements as numpy ``[ne3, ne2, ne1, ne0]``, strides honoured,
    copied from device memory first when the tensor does not live in host memory.

    Raises IntegrityError for another element type or a tensor without data.
    """
    if tensor.type not in _ITEM_DTYPES:
        raise IntegrityError(f"tensor {tensor.name!r} has ggml type {tensor.type}; only F32 and I32 are read")
    if not tensor.data:
        raise IntegrityError(f"tensor {tensor.name!r} has no data")
    lib = ggml_library()
    address = ctypes.addressof(tensor)
    n_bytes = int(lib.ggml_nbytes(address))
    if tensor.buffer and not lib.ggml_backend_buffer_is_host(tensor.buffer):
        raw = np.empty(n_bytes, dtype=np.uint8)
        lib.ggml_backend_tensor_get(address, raw.ctypes.data, 0, n_bytes)
    else:
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * n_bytes).from_address(tensor.data))
    shape = tuple(int(tensor.ne[i]) for i in reversed(range(GGML_MAX_DIMS)))
    strides = tuple(int(tensor.nb[i]) for i in reversed(range(GGML_MAX_DIMS)))
    if strides[-1] != _ITEM_BYTES[tensor.type]:
        raise IntegrityError(
            f"tensor {tensor.name!r}: element stride {strides[-1]}, expected contiguous rows"
        )
    return np.array(_typed_view(raw, tensor.type, shape, strides))


def _typed_view(
    raw: npt.NDArray[np.uint8], ggml_type: int, shape: tuple[int, ...], strides: tuple[int, ...]
) -> Any:
    base = np.frombuffer(raw, dtype=_ITEM_DTYPES[ggml_type], count=raw.size // _ITEM_BYTES[ggml_type])
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides, writeable=False)
