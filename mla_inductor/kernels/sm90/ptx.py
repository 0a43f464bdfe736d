"""Inline-PTX instructions the SM90 kernels need and CuTe DSL does not wrap (PTX ISA 8.x names)."""

from __future__ import annotations

from typing import Optional

from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(ptx: str, constraints: str, operands=(), result=None, *, loc=None, ip=None):
    """One side-effecting inline-PTX statement over ``operands`` (DSL numbers)."""
    return llvm.inline_asm(
        result,
        [x.ir_value(loc=loc, ip=ip) for x in operands],
        ptx,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def create_policy(evict_last: bool, *, loc=None, ip=None) -> Int64:
    """An L2 cache policy (``createpolicy.fractional``, fraction 1.0): evict_last or evict_first."""
    kind = "evict_last" if evict_last else "evict_first"
    return Int64(_asm(f"createpolicy.fractional.L2::{kind}.b64 $0, 1.0;", "=l", (), T.i64(),
                      loc=loc, ip=ip))


@dsl_user_op
def cp_async_16(dst: Int32, src: Int64, src_bytes: Int32, policy: Optional[Int64] = None, *,
                loc=None, ip=None) -> None:
    """``cp.async.cg`` of 16 bytes global -> shared; ``src_bytes = 0`` zero-fills (reads nothing).
    With an L2 ``policy`` (:func:`create_policy`) the copy carries it and a 256-byte L2 prefetch
    hint."""
    operands = [Int32(dst), Int64(src), Int32(src_bytes)]
    if policy is None:
        _asm("cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", operands, loc=loc, ip=ip)
    else:
        _asm("cp.async.cg.shared.global.L2::cache_hint.L2::256B [$0], [$1], 16, $2, $3;",
             "r,l,r,l", operands + [Int64(policy)], loc=loc, ip=ip)


@dsl_user_op
def cp_async_4(dst: Int32, src: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.ca`` of 4 bytes global -> shared; ``src_bytes = 0`` zero-fills (reads nothing)."""
    _asm("cp.async.ca.shared.global [$0], [$1], 4, $2;", "r,l,r",
         [Int32(dst), Int64(src), Int32(src_bytes)], loc=loc, ip=ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """``cp.async.wait_all``: this thread's outstanding ``cp.async`` copies have landed."""
    _asm("cp.async.wait_all;", "", loc=loc, ip=ip)


@dsl_user_op
def red_add_f32x4(addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, pred: Int32,
                  policy: Int64, *, loc=None, ip=None) -> None:
    """``red.global.add.v4.f32`` of four adjacent words (16-byte aligned) with an L2 ``policy``
    (:func:`create_policy`), issued iff ``pred != 0``."""
    _asm(
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
        "@p red.relaxed.gpu.global.add.L2::cache_hint.v4.f32 [$0], {$1, $2, $3, $4}, $6;\n}",
        "l,f,f,f,f,r,l",
        (Int64(addr), Float32(a), Float32(b), Float32(c), Float32(d), Int32(pred),
         Int64(policy)),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def red_add_fixed64(addr: Int64, x: Float32, pred: Int32, policy: Int64, *, loc=None,
                    ip=None) -> None:
    """Adds ``x`` (already multiplied by the fixed-point scale) to the signed 64-bit integer at
    ``addr`` (8-byte aligned): ``cvt.rni.s64.f32`` (round to nearest even), then
    ``red.global.add.u64`` with an L2 ``policy`` (:func:`create_policy`), issued iff
    ``pred != 0``. Two's-complement addition is associative, so the sum of any set of such
    adds is the same in every order."""
    _asm(
        "{\n.reg .pred p;\n.reg .s64 v;\nsetp.ne.b32 p, $2, 0;\ncvt.rni.s64.f32 v, $1;\n"
        "@p red.relaxed.gpu.global.add.L2::cache_hint.u64 [$0], v, $3;\n}",
        "l,f,r,l",
        (Int64(addr), Float32(x), Int32(pred), Int64(policy)),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def red_add_shared_f32(addr: Int32, x: Float32, *, loc=None, ip=None) -> None:
    """``red.shared.add.f32`` of ``x`` to the word at shared address ``addr``."""
    _asm("red.shared.add.f32 [$0], $1;", "r,f", (Int32(addr), Float32(x)), loc=loc, ip=ip)


@dsl_user_op
def opaque_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x``, through a volatile move: values derived from it are recomputed where they are used
    instead of being hoisted out of the loop (and kept live in registers) by the compiler."""
    return Int32(_asm("mov.b32 $0, $1;", "=r,r", (Int32(x),), T.i32(), loc=loc, ip=ip))


@dsl_user_op
def st_shared_b32(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    """``st.shared.b32``, no clobber (:func:`st_shared_b32_ordered` has a ``memory`` one)."""
    _asm("st.shared.b32 [$0], $1;", "r,r", (Int32(addr), Int32(v)), loc=loc, ip=ip)


@dsl_user_op
def st_global_v4_b32(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, pred: Int32,
                     policy: Int64, *, loc=None, ip=None) -> None:
    """``st.global.v4.b32`` of four words to a 16-byte aligned address with an L2 ``policy``
    (:func:`create_policy`), issued iff ``pred != 0``."""
    _asm(
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
        "@p st.global.L2::cache_hint.v4.b32 [$0], {$1, $2, $3, $4}, $6;\n}",
        "l,r,r,r,r,r,l",
        (Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d), Int32(pred), Int64(policy)),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bit pattern of ``x`` (``mov.b32``)."""
    return Int32(_asm("mov.b32 $0, $1;", "=r,f", (Float32(x),), T.i32(), loc=loc, ip=ip))


@dsl_user_op
def f32_from_bits(x: Int32, *, loc=None, ip=None) -> Float32:
    """The float32 whose bit pattern is ``x`` (``mov.b32``)."""
    return Float32(_asm("mov.b32 $0, $1;", "=f,r", (Int32(x),), T.f32(), loc=loc, ip=ip))


@dsl_user_op
def relu_nan(x: Float32, *, loc=None, ip=None) -> Float32:
    """``max(x, 0)`` that keeps a NaN (``max.NaN.f32``)."""
    return Float32(_asm("max.NaN.f32 $0, $1, 0f00000000;", "=f,f", (Float32(x),), T.f32(),
                        loc=loc, ip=ip))


@dsl_user_op
def ld_global_nc_b32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """``ld.global.nc.b32``: one word from global memory through the non-coherent (read-only)
    path."""
    return Int32(_asm("ld.global.nc.b32 $0, [$1];", "=r,l", (Int64(addr),), T.i32(), loc=loc,
                      ip=ip))


@dsl_user_op
def ld_global_nc_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """``ld.global.nc.f32``: one float32 from global memory through the non-coherent path."""
    return Float32(_asm("ld.global.nc.f32 $0, [$1];", "=f,l", (Int64(addr),), T.f32(), loc=loc,
                        ip=ip))


@dsl_user_op
def st_global_b32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """``st.global.b32``."""
    _asm("st.global.b32 [$0], $1;", "l,r", (Int64(addr), Int32(v)), loc=loc, ip=ip)


@dsl_user_op
def st_global_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    """``st.global.f32``."""
    _asm("st.global.f32 [$0], $1;", "l,f", (Int64(addr), Float32(v)), loc=loc, ip=ip)


@dsl_user_op
def max_nan(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``max(a, b)`` that keeps a NaN (``max.NaN.f32``)."""
    return Float32(_asm("max.NaN.f32 $0, $1, $2;", "=f,f,f", (Float32(a), Float32(b)), T.f32(),
                        loc=loc, ip=ip))


@dsl_user_op
def ld_shared_b32(addr: Int32, *, loc=None, ip=None) -> Int32:
    """``ld.shared.b32``."""
    return Int32(_asm("ld.shared.b32 $0, [$1];", "=r,r,~{memory}", [Int32(addr)], T.i32(),
                      loc=loc, ip=ip))


@dsl_user_op
def st_shared_u16(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    """``st.shared.u16`` of the low 16 bits of ``v``."""
    _asm("{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.shared.u16 [$0], t;\n}", "r,r",
         (Int32(addr), Int32(v)), loc=loc, ip=ip)


@dsl_user_op
def e4m3x2_from_f32(hi: Float32, lo: Float32, *, loc=None, ip=None) -> Int32:
    """Two floats rounded to float8_e4m3fn (``cvt.rn.satfinite.e4m3x2.f32``: to nearest even,
    finite values past 448 to +-448, NaN to NaN) in the low 16 bits: ``lo`` in byte 0, ``hi``
    in byte 1."""
    return Int32(_asm("{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, $1, $2;\n"
                      "cvt.u32.u16 $0, t;\n}", "=r,f,f", (Float32(hi), Float32(lo)), T.i32(),
                      loc=loc, ip=ip))


@dsl_user_op
def f32_from_e4m3(x: Int32, byte: int, *, loc=None, ip=None) -> Float32:
    """The float8_e4m3fn value in byte ``byte`` (0 or 1) of ``x``, exactly, as a float
    (``cvt.rn.f16x2.e4m3x2``: every e4m3 value is an f16)."""
    return Float32(_asm("{\n.reg .b16 t, h0, h1;\n.reg .b32 p;\ncvt.u16.u32 t, $1;\n"
                        "cvt.rn.f16x2.e4m3x2 p, t;\nmov.b32 {h0, h1}, p;\n"
                        f"cvt.f32.f16 $0, h{byte};\n}}", "=f,r", (Int32(x),), T.f32(),
                        loc=loc, ip=ip))


def _asm_v4(ptx: str, constraints: str, operands, *, loc=None, ip=None):
    """:func:`_asm` with four 32-bit results, as a list of ``Int32``."""
    res = _asm(ptx, constraints, operands, ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>"),
               loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_global_v4(addr: Int64, *, loc=None, ip=None):
    """``ld.global.nc.v4.b32``: four words from a 16-byte aligned global address."""
    return _asm_v4("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                   [Int64(addr)], loc=loc, ip=ip)


@dsl_user_op
def ld_shared_v4(addr: Int32, *, loc=None, ip=None):
    """``ld.shared.v4.b32``: four words from a 16-byte aligned shared address."""
    return _asm_v4("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                   [Int32(addr)], loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4(addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None):
    """``st.shared.v4.b32`` to a 16-byte aligned shared address."""
    _asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
         [Int32(addr), Int32(a), Int32(b), Int32(c), Int32(d)], loc=loc, ip=ip)


@dsl_user_op
def st_shared_b32_ordered(addr: Int32, v: Int32, *, loc=None, ip=None):
    """``st.shared.b32`` with a ``memory`` clobber (unlike :func:`st_shared_b32`): the compiler
    keeps every other memory access on its side of the store (the top-k select's shared-memory
    words are read back through other inline PTX)."""
    _asm("st.shared.b32 [$0], $1;", "r,r,~{memory}", [Int32(addr), Int32(v)], loc=loc, ip=ip)


@dsl_user_op
def atom_shared_add(addr: Int32, v: Int32, *, loc=None, ip=None) -> Int32:
    """``atom.shared.add.u32 [addr], v``: the previous value."""
    return Int32(_asm("atom.shared.add.u32 $0, [$1], $2;", "=r,r,r,~{memory}",
                      [Int32(addr), Int32(v)], T.i32(), loc=loc, ip=ip))


@dsl_user_op
def red_shared_add_1(addr: Int32, *, loc=None, ip=None):
    """``red.shared.add.u32 [addr], 1``."""
    _asm("red.shared.add.u32 [$0], 1;", "r,~{memory}", [Int32(addr)], loc=loc, ip=ip)


@dsl_user_op
def red_shared_or(addr: Int32, v: Int32, *, loc=None, ip=None):
    """``red.shared.or.b32 [addr], v``."""
    _asm("red.shared.or.b32 [$0], $1;", "r,r,~{memory}", [Int32(addr), Int32(v)], loc=loc,
         ip=ip)


@dsl_user_op
def st_shared_v2(addr: Int32, a: Int32, b: Int32, *, loc=None, ip=None):
    """``st.shared.v2.b32`` to an 8-byte aligned shared address."""
    _asm("st.shared.v2.b32 [$0], {$1, $2};", "r,r,r,~{memory}",
         [Int32(addr), Int32(a), Int32(b)], loc=loc, ip=ip)


@dsl_user_op
def ge_or_nan(x: Int32, t: Int32, *, loc=None, ip=None) -> Int32:
    """1 when the float with bits ``x`` is at least the float with bits ``t`` or either is NaN
    (``setp.geu.f32``), else 0."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip), Int32(t).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; .reg .f32 a, b; mov.b32 a, $1; mov.b32 b, $2; "
        "setp.geu.f32 p, a, b; selp.u32 $0, 1, 0, p; }", "=r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def popc(x: Int32, *, loc=None, ip=None) -> Int32:
    """``popc.b32``: the number of set bits."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)],
                                 "popc.b32 $0, $1;", "=r,r", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))
