"""mma.sync m16n8k16 (16-bit operands, sm_80+) and m16n8k32 (e4m3 operands, sm_89+) with f32
accumulators (``ptx/mma.cu``).

``acc``: 4 float32 (updated in place), ``a``: 4 uint32, ``b``: 2 uint32 — each a local
array or a row of one, holding this lane's part of the fragment (PTX ISA fragment layout). An
e4m3 register holds four 8-bit values, the lowest column in the lowest byte; a kernel that calls
the e4m3 mma compiles only for sm_89 and later (ptxas refuses it below).
"""

from __future__ import annotations

import cffi
from numba import cuda, types

from ._declare import declare, f32p, u32p

_ffi = cffi.FFI()
_sig = types.void(f32p, u32p, u32p)
_f16 = declare("mma", "mma_m16n8k16_f32_f16", _sig)
_bf16 = declare("mma", "mma_m16n8k16_f32_bf16", _sig)
_e4m3 = declare("mma", "mma_m16n8k32_f32_e4m3", _sig)


@cuda.jit(device=True, forceinline=True)
def mma_m16n8k16_f16(acc, a, b):
    """acc += A(16x16, f16, row) @ B(16x8, f16, col)."""
    _f16(_ffi.from_buffer(acc), _ffi.from_buffer(a), _ffi.from_buffer(b))


@cuda.jit(device=True, forceinline=True)
def mma_m16n8k16_bf16(acc, a, b):
    """acc += A(16x16, bf16, row) @ B(16x8, bf16, col)."""
    _bf16(_ffi.from_buffer(acc), _ffi.from_buffer(a), _ffi.from_buffer(b))


@cuda.jit(device=True, forceinline=True)
def mma_m16n8k32_e4m3(acc, a, b):
    """acc += A(16x32, e4m3, row) @ B(32x8, e4m3, col); sm_89+."""
    _e4m3(_ffi.from_buffer(acc), _ffi.from_buffer(a), _ffi.from_buffer(b))
