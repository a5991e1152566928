"""ldmatrix x1/x2/x4, plain and transposed (``ptx/ldmatrix.cu``).

``regs`` is a uint32 register array (a local array or a row of one) receiving 1, 2 or 4
registers; ``address`` is this lane's 32-bit shared address of one 16-byte matrix row.
"""

from __future__ import annotations

import cffi
from numba import cuda, types

from ._declare import declare, u32p

_ffi = cffi.FFI()
_sig = types.void(u32p, types.uint32)
_x1 = declare("ldmatrix", "ldmatrix_x1", _sig)
_x2 = declare("ldmatrix", "ldmatrix_x2", _sig)
_x4 = declare("ldmatrix", "ldmatrix_x4", _sig)
_x1_trans = declare("ldmatrix", "ldmatrix_x1_trans", _sig)
_x2_trans = declare("ldmatrix", "ldmatrix_x2_trans", _sig)
_x4_trans = declare("ldmatrix", "ldmatrix_x4_trans", _sig)


@cuda.jit(device=True, forceinline=True)
def ldmatrix_x1(regs, address):
    _x1(_ffi.from_buffer(regs), address)


@cuda.jit(device=True, forceinline=True)
def ldmatrix_x2(regs, address):
    _x2(_ffi.from_buffer(regs), address)


@cuda.jit(device=True, forceinline=True)
def ldmatrix_x4(regs, address):
    _x4(_ffi.from_buffer(regs), address)


@cuda.jit(device=True, forceinline=True)
def ldmatrix_x1_trans(regs, address):
    _x1_trans(_ffi.from_buffer(regs), address)


@cuda.jit(device=True, forceinline=True)
def ldmatrix_x2_trans(regs, address):
    _x2_trans(_ffi.from_buffer(regs), address)


@cuda.jit(device=True, forceinline=True)
def ldmatrix_x4_trans(regs, address):
    _x4_trans(_ffi.from_buffer(regs), address)
