"""Packing f32 pairs into 16-bit pairs, and the fast exp2 (``ptx/convert.cu``).

Warp shuffles are Numba's own (``cuda.shfl_xor_sync``).
"""

from __future__ import annotations

from numba import types

from ._declare import declare

_f32 = types.float32
pack_f16x2 = declare("convert", "cvt_rn_f16x2_f32", types.uint32(_f32, _f32))
pack_f16x2.__doc__ = "pack_f16x2(lo, hi) -> uint32 with f16(lo) in bits 0-15, f16(hi) in 16-31."
pack_bf16x2 = declare("convert", "cvt_rn_bf16x2_f32", types.uint32(_f32, _f32))
pack_bf16x2.__doc__ = "pack_bf16x2(lo, hi) -> uint32 with bf16(lo) low, bf16(hi) high."
pack_e4m3x4 = declare("convert", "cvt_rn_satfinite_e4m3x4_f32", types.uint32(_f32, _f32, _f32, _f32))
pack_e4m3x4.__doc__ = ("pack_e4m3x4(a0, a1, a2, a3) -> uint32 of four e4m3 (sm_89+), a0 in bits 0-7 ... a3 "
                       "in 24-31; round to nearest even, finite values past +-448 saturate, NaN stays NaN.")
exp2 = declare("convert", "ex2_approx_ftz_f32", _f32(_f32))
exp2.__doc__ = "exp2(x) -> 2**x (ex2.approx.ftz.f32)."
reciprocal = declare("convert", "rcp_approx_ftz_f32", _f32(_f32))
reciprocal.__doc__ = "reciprocal(x) -> 1/x (rcp.approx.ftz.f32)."
log2 = declare("convert", "lg2_approx_ftz_f32", _f32(_f32))
log2.__doc__ = "log2(x) -> log2(x) (lg2.approx.ftz.f32)."
exp2_poly = declare("convert", "ex2_poly3_f32", _f32(_f32))
exp2_poly.__doc__ = ("exp2_poly(x) -> 2**x on the FMA pipe (degree-3 polynomial, relative error < 8e-5; "
                     "0 below -126; x <= 127), for kernels bound by the MUFU unit.")
f32_from_f16_bits = declare("convert", "cvt_f32_f16_bits", _f32(types.uint32))
f32_from_f16_bits.__doc__ = "f32_from_f16_bits(h) -> the f16 in the low 16 bits of h, as f32 (exact)."
f32_from_bf16_bits = declare("convert", "cvt_f32_bf16_bits", _f32(types.uint32))
f32_from_bf16_bits.__doc__ = "f32_from_bf16_bits(h) -> the bf16 in the low 16 bits of h, as f32 (exact)."
byte_perm = declare("convert", "prmt_b32", types.uint32(types.uint32, types.uint32, types.uint32))
byte_perm.__doc__ = ("byte_perm(a, b, selector) -> uint32 whose byte i is byte (selector >> 4i) & 7 of the "
                     "eight bytes of a (0-3) and b (4-7) (prmt.b32).")
