"""LLVM-IR steps the compiled kernels share (numba intrinsics), in 16-lane vectors.

LLVM does not vectorise these from plain loops (small trip counts, or a compress, which has no
loop form), and scalar versions cost 5-10x more. The IR is generic LLVM except for the AVX-512
register compress, used only when numba compiles for a host that has it; elsewhere LLVM's
generic compress-store is lowered to what the CPU has. The kernels that inline these stamp
their numba cache with this file too (`_kernel_stamp`).
"""

# mypy: disable-error-code="no-untyped-def,no-untyped-call,call-arg"
from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

__all__ = ["REGISTER_COMPRESS", "compress16", "compress_index16", "rank16", "f64_bits", "bits_f64",
           "pack_tq2", "pack_tq1"]

def _host_has_avx512() -> bool:
    """AVX-512F on the host numba compiles for; never when the target CPU is overridden
    (NUMBA_CPU_NAME), since the cached code must then run on other CPUs."""
    try:
        import llvmlite.binding as llvm

        if getattr(numba.config, "CPU_NAME", None) is not None:
            return False
        return bool(llvm.get_host_cpu_features().get("avx512f", False))
    except Exception:  # pragma: no cover - unusual llvmlite builds
        return False


REGISTER_COMPRESS = _host_has_avx512()

_VEC = ir.VectorType(ir.FloatType(), 16)
_VEC_I32 = ir.VectorType(ir.IntType(32), 16)


def _splat(builder: Any, value: Any, vec_t: Any) -> Any:
    one = builder.insert_element(ir.Constant(vec_t, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vec_t.count), [0] * vec_t.count)
    return builder.shuffle_vector(one, ir.Constant(vec_t, ir.Undefined), zeros)


def _data(context: Any, builder: Any, ary_t: Any, ary: Any) -> Any:
    return context.make_array(ary_t)(context, builder, ary).data


def _load_vec(builder: Any, data: Any, offset: Any, vec_t: Any, align: int = 4) -> Any:
    ptr = builder.bitcast(builder.gep(data, [offset]), vec_t.as_pointer())
    return builder.load(ptr, align=align)


def _popcount16(builder: Any, mask: Any) -> Any:
    i16 = ir.IntType(16)
    pop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
    return builder.zext(builder.call(pop, [builder.bitcast(mask, i16)]), ir.IntType(64))


def _compress_store(builder: Any, values: Any, mask: Any, dst_p: Any) -> None:
    """Store the lanes of ``values`` that ``mask`` selects at ``dst_p``, in order. With AVX-512
    the compress happens in a register and all 16 lanes are stored (compressing straight to
    memory is microcoded and slow on some CPUs, Zen 4 among them)."""
    vec_t = values.type
    suffix = "v16f32" if vec_t == _VEC else "v16i32"
    if REGISTER_COMPRESS:
        fn_t = ir.FunctionType(vec_t, [vec_t, vec_t, mask.type])
        fn = cgutils.get_or_insert_function(builder.module, fn_t, f"llvm.x86.avx512.mask.compress.{suffix}")
        packed = builder.call(fn, [values, ir.Constant(vec_t, ir.Undefined), mask])
        builder.store(packed, builder.bitcast(dst_p, vec_t.as_pointer()), align=4)
    else:
        fn_t = ir.FunctionType(ir.VoidType(), [vec_t, dst_p.type, mask.type])
        fn = cgutils.get_or_insert_function(builder.module, fn_t, f"llvm.masked.compressstore.{suffix}")
        builder.call(fn, [values, dst_p, mask])


def _window_mask(context: Any, builder: Any, signature: Any, src_v: Any, i0_v: Any, lo_v: Any,
                 hi_v: Any) -> Any:
    """(the 16 float32 ``src[i0:i0+16]``, the mask of those with ``lo < x <= hi``)."""
    vec = _load_vec(builder, _data(context, builder, signature.args[0], src_v), i0_v, _VEC)
    mask = builder.and_(
        builder.fcmp_ordered(">", vec, _splat(builder, lo_v, _VEC)),
        builder.fcmp_ordered("<=", vec, _splat(builder, hi_v, _VEC)),
    )
    return vec, mask


@intrinsic
def compress16(typingctx: Any, src: Any, i0: Any, lo: Any, hi: Any, dst: Any, pos: Any) -> Any:
    """Store the x of float32 ``src[i0:i0+16]`` with ``lo < x <= hi`` at ``dst[pos:]`` in order;
    return ``pos`` + how many. ``dst`` needs 16 slots past ``pos``."""
    sig = nbtypes.intp(src, nbtypes.intp, nbtypes.float32, nbtypes.float32, dst, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        src_v, i0_v, lo_v, hi_v, dst_v, pos_v = args
        vec, mask = _window_mask(context, builder, signature, src_v, i0_v, lo_v, hi_v)
        dst_p = builder.gep(_data(context, builder, signature.args[4], dst_v), [pos_v])
        _compress_store(builder, vec, mask, dst_p)
        return builder.add(pos_v, _popcount16(builder, mask))

    return sig, codegen


@intrinsic
def compress_index16(typingctx: Any, src: Any, i0: Any, lo: Any, hi: Any, dst: Any, pos: Any) -> Any:
    """Store the indices i in [i0, i0 + 16) with ``lo < src[i] <= hi`` (float32) at int32
    ``dst[pos:]``, in order; return ``pos`` + how many. ``dst`` needs 16 slots past ``pos``."""
    sig = nbtypes.intp(src, nbtypes.intp, nbtypes.float32, nbtypes.float32, dst, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        src_v, i0_v, lo_v, hi_v, dst_v, pos_v = args
        _, mask = _window_mask(context, builder, signature, src_v, i0_v, lo_v, hi_v)
        base = _splat(builder, builder.trunc(i0_v, ir.IntType(32)), _VEC_I32)
        idx = builder.add(base, ir.Constant(_VEC_I32, list(range(16))))
        dst_p = builder.gep(_data(context, builder, signature.args[4], dst_v), [pos_v])
        _compress_store(builder, idx, mask, dst_p)
        return builder.add(pos_v, _popcount16(builder, mask))

    return sig, codegen


@intrinsic
def rank16(typingctx: Any, v: Any, c: Any, x: Any, j: Any) -> Any:
    """How many of float32 ``v[c:c+16]`` precede ``x = v[j]`` in a stable descending order
    (greater, or equal and at a lower index)."""
    sig = nbtypes.intp(v, nbtypes.intp, nbtypes.float32, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v_v, c_v, x_v, j_v = args
        vec = _load_vec(builder, _data(context, builder, signature.args[0], v_v), c_v, _VEC)
        xs = _splat(builder, x_v, _VEC)
        idx_t = ir.VectorType(ir.IntType(64), 16)
        lanes = builder.add(_splat(builder, c_v, idx_t), ir.Constant(idx_t, list(range(16))))
        before = builder.and_(
            builder.fcmp_ordered("==", vec, xs), builder.icmp_signed("<", lanes, _splat(builder, j_v, idx_t))
        )
        return _popcount16(builder, builder.or_(builder.fcmp_ordered(">", vec, xs), before))

    return sig, codegen


def _load_bytes(builder: Any, data: Any, offset: int, lanes: int) -> Any:
    offset_c = ir.Constant(ir.IntType(64), offset)
    return _load_vec(builder, data, offset_c, ir.VectorType(ir.IntType(8), lanes), align=1)


def _store_bytes(builder: Any, data: Any, base: Any, offset: int, value: Any) -> None:
    ptr = builder.gep(data, [builder.add(base, ir.Constant(base.type, offset))])
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=1)


@intrinsic
def pack_tq2(typingctx: Any, q: Any, out: Any, base: Any) -> Any:
    """TQ2_0 code bytes of uint8 codes ``q[0:256]`` (0, 1, 2) at ``out[base:base+64]``: element n
    goes to byte ``32 (n // 128) + n % 32`` at bit shift ``2 ((n % 128) // 32)``."""
    sig = nbtypes.void(q, out, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        q_v, out_v, base_v = args
        qd = _data(context, builder, signature.args[0], q_v)
        od = _data(context, builder, signature.args[1], out_v)
        for half in range(2):
            acc = _load_bytes(builder, qd, 128 * half, 32)
            for plane in range(1, 4):
                codes = _load_bytes(builder, qd, 128 * half + 32 * plane, 32)
                acc = builder.or_(acc, builder.shl(codes, ir.Constant(codes.type, [2 * plane] * 32)))
            _store_bytes(builder, od, base_v, 32 * half, acc)
        return context.get_dummy_value()

    return sig, codegen


def _base3_bytes(builder: Any, qd: Any, start: int, stride: int, count: int, lanes: int) -> Any:
    """``ceil(v * 256 / 243)`` for v the ``count`` trits ``q[start + i * stride + lane]``, most
    significant first (times 3 more when there are 4, as TQ1_0's ``qh`` stores them)."""
    vec_t = ir.VectorType(ir.IntType(16), lanes)

    def const(value: int) -> Any:
        return ir.Constant(vec_t, [value] * lanes)

    v = None
    for i in range(count):
        trit = builder.zext(_load_bytes(builder, qd, start + i * stride, lanes), vec_t)
        v = trit if v is None else builder.add(builder.mul(v, const(3)), trit)
    if count == 4:
        v = builder.mul(v, const(3))
    encoded = builder.udiv(builder.add(builder.mul(v, const(256)), const(242)), const(243))
    return builder.trunc(encoded, ir.VectorType(ir.IntType(8), lanes))


@intrinsic
def pack_tq1(typingctx: Any, q: Any, out: Any, base: Any) -> Any:
    """TQ1_0 code bytes of uint8 codes ``q[0:256]`` at ``out[base:base+52]`` (layout: `codecs.tq.TQ1_0`)."""
    sig = nbtypes.void(q, out, nbtypes.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        q_v, out_v, base_v = args
        qd = _data(context, builder, signature.args[0], q_v)
        od = _data(context, builder, signature.args[1], out_v)
        _store_bytes(builder, od, base_v, 0, _base3_bytes(builder, qd, 0, 32, 5, 32))
        _store_bytes(builder, od, base_v, 32, _base3_bytes(builder, qd, 160, 16, 5, 16))
        _store_bytes(builder, od, base_v, 48, _base3_bytes(builder, qd, 240, 4, 4, 4))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f64_bits(typingctx: Any, x: Any) -> Any:
    """The IEEE bit pattern of a float64, as int64 (a register bitcast)."""
    sig = nbtypes.int64(nbtypes.float64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(nbtypes.int64))

    return sig, codegen


@intrinsic
def bits_f64(typingctx: Any, b: Any) -> Any:
    """The float64 whose IEEE bit pattern is the int64 ``b``."""
    sig = nbtypes.float64(nbtypes.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(nbtypes.float64))

    return sig, codegen
