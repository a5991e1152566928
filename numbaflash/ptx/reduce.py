"""Reductions into global memory and the acquire/release pair that orders them between CTAs
(``ptx/reduce.cu``): the backward adds dQ into a float32 buffer with ``red_global_add_f32``
(on sm_90 ``red_global_add_v4_f32``, four adjacent floats at once), and in deterministic mode
takes turns per query block with ``ld_acquire_gpu_s32`` / ``red_release_gpu_add_s32`` on a
counter; a GQA group split over CTAs adds dK and dV into float32 sums the same way, and the
CTA that takes the last ticket (``atom_add_acq_rel_gpu_s32``) reads them back
(``ld_relaxed_gpu_v4_f32``).

Addresses are generic byte addresses of global memory (int64), from ``global_address_f32`` /
``global_address_i32`` plus an offset.
"""

from __future__ import annotations

import cffi
from numba import cuda, types

from ._declare import declare, f32p

_ffi = cffi.FFI()

_i64 = types.int64
_address_f32 = declare("reduce", "global_address_f32", _i64(f32p))
_address_i32 = declare("reduce", "global_address_i32", _i64(types.CPointer(types.int32)))  # int*
red_global_add_f32 = declare("reduce", "red_global_add_f32", types.void(_i64, types.float32))
red_global_add_f32.__doc__ = "red_global_add_f32(address, v): *address += v (float32, global, relaxed)."
red_global_add_v4_f32 = declare("reduce", "red_global_add_v4_f32",
                                types.void(_i64, types.float32, types.float32, types.float32, types.float32))
red_global_add_v4_f32.__doc__ = ("red_global_add_v4_f32(address, a, b, c, d): address[0..3] += (a, b, c, d) "
                                 "(float32, 16-byte aligned, global, relaxed; sm_90 on).")
ld_acquire_gpu_s32 = declare("reduce", "ld_acquire_gpu_s32", types.int32(_i64))
ld_acquire_gpu_s32.__doc__ = "ld_acquire_gpu_s32(address) -> int32 *address, acquire order at GPU scope."
red_release_gpu_add_s32 = declare("reduce", "red_release_gpu_add_s32", types.void(_i64, types.int32))
red_release_gpu_add_s32.__doc__ = "red_release_gpu_add_s32(a, v): *a += v, release order at GPU scope."
atom_add_acq_rel_gpu_s32 = declare("reduce", "atom_add_acq_rel_gpu_s32", types.int32(_i64, types.int32))
atom_add_acq_rel_gpu_s32.__doc__ = ("atom_add_acq_rel_gpu_s32(a, v) -> the old *a; *a += v, acquire "
                                    "and release order at GPU scope (a ticket).")
_ld_relaxed_gpu_v4_f32 = declare("reduce", "ld_relaxed_gpu_v4_f32", types.void(f32p, _i64))


@cuda.jit(device=True, forceinline=True)
def ld_relaxed_gpu_v4_f32(regs, address):
    """Load the four float32 at the global byte address ``address`` (int64, 16-byte aligned) into
    ``regs[0:4]``: a relaxed load at GPU scope, which reads L2 (after an acquire it sees what
    other CTAs reduced there)."""
    _ld_relaxed_gpu_v4_f32(_ffi.from_buffer(regs), address)


@cuda.jit(device=True, forceinline=True)
def global_address_f32(array):
    """Byte address (int64) of element 0 of a float32 device array."""
    return _address_f32(_ffi.from_buffer(array))


@cuda.jit(device=True, forceinline=True)
def global_address_i32(array):
    """Byte address (int64) of element 0 of an int32 device array."""
    return _address_i32(_ffi.from_buffer(array))
