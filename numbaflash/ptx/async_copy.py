"""cp.async copies, shared-address conversion and 16-byte vector moves (``ptx/copy.cu``).

Kernel code passes arrays and element indices; pointers and address spaces stay here.
Shared-memory addresses are 32-bit byte addresses in the shared window (``uint32``).
"""

from __future__ import annotations

import cffi
from numba import cuda, types

from ._declare import declare, f32p, u16p, u32p, u64p

_ffi = cffi.FFI()
_u32 = types.uint32

_cvta_u16 = declare("copy", "cvta_to_shared_u16", _u32(u16p))
_cvta_u32 = declare("copy", "cvta_to_shared_u32", _u32(u32p))
_cvta_f32 = declare("copy", "cvta_to_shared_f32", _u32(f32p))
_cvta_u64 = declare("copy", "cvta_to_shared_u64", _u32(u64p))
_i64 = types.int64
_cp_async_16 = declare("copy", "cp_async_cg_shared_global_16", types.void(_u32, u16p, _i64))
_cp_async_16_zfill = declare(
    "copy", "cp_async_cg_shared_global_16_zfill", types.void(_u32, u16p, _i64, _u32)
)
_global_address_u16 = declare("copy", "global_address_u16", _i64(u16p))
_cp_async_16_at = declare("copy", "cp_async_cg_16_at", types.void(_u32, _i64))
_cp_async_16_zfill_at = declare("copy", "cp_async_cg_16_zfill_at", types.void(_u32, _i64, _u32))
cp_async_commit_group = declare("copy", "cp_async_commit_group", types.void())
cp_async_wait_group_0 = declare("copy", "cp_async_wait_group_0", types.void())
cp_async_wait_group_1 = declare("copy", "cp_async_wait_group_1", types.void())
cp_async_wait_group_2 = declare("copy", "cp_async_wait_group_2", types.void())
cp_async_wait_group_3 = declare("copy", "cp_async_wait_group_3", types.void())
# cp_async_wait_group_<n> by n, for a kernel factory to pick one from a compile-time count.
CP_ASYNC_WAIT_GROUP = (cp_async_wait_group_0, cp_async_wait_group_1, cp_async_wait_group_2,
                       cp_async_wait_group_3)
_ld_shared_v4 = declare("copy", "ld_shared_v4_b32", types.void(u32p, _u32))
_st_shared_v4 = declare("copy", "st_shared_v4_b32", types.void(_u32, u32p))
st_shared_b32 = declare("copy", "st_shared_b32", types.void(_u32, _u32))
_f32 = types.float32
st_shared_v4_f32 = declare("copy", "st_shared_v4_f32", types.void(_u32, _f32, _f32, _f32, _f32))
st_shared_v4_f32.__doc__ = "st_shared_v4_f32(address, a, b, c, d): four floats at a shared address."
ld_shared_f32 = declare("copy", "ld_shared_f32", types.float32(_u32))
ld_shared_b32 = declare("copy", "ld_shared_b32", _u32(_u32))
ld_shared_b32.__doc__ = "ld_shared_b32(address) -> uint32 at a shared byte address."
_st_global_v4 = declare("copy", "st_global_v4_b32", types.void(u16p, _i64, u32p))
_st_global_v4_at = declare("copy", "st_global_v4_b32_at", types.void(_i64, u32p))
_ld_global_nc_v4_at = declare("copy", "ld_global_nc_v4_b32_at", types.void(u32p, _i64))


@cuda.jit(device=True, forceinline=True)
def shared_address_u16(array):
    """32-bit shared-window byte address of element 0 of a uint16 shared array."""
    return _cvta_u16(_ffi.from_buffer(array))


@cuda.jit(device=True, forceinline=True)
def shared_address_u32(array):
    """32-bit shared-window byte address of element 0 of a uint32 shared array."""
    return _cvta_u32(_ffi.from_buffer(array))


@cuda.jit(device=True, forceinline=True)
def shared_address_f32(array):
    """32-bit shared-window byte address of element 0 of a float32 shared array."""
    return _cvta_f32(_ffi.from_buffer(array))


@cuda.jit(device=True, forceinline=True)
def shared_address_u64(array):
    """32-bit shared-window byte address of element 0 of a uint64 shared array."""
    return _cvta_u64(_ffi.from_buffer(array))


@cuda.jit(device=True, forceinline=True)
def cp_async_16(dst_shared, src, src_index):
    """Copy 8 uint16 (16 bytes) from ``src[src_index:]`` (global, 1-D) to ``dst_shared``.
    The index is not bounds-checked (the pointer arithmetic happens in the helper)."""
    _cp_async_16(dst_shared, _ffi.from_buffer(src), src_index)


@cuda.jit(device=True, forceinline=True)
def cp_async_16_zfill(dst_shared, src, src_index, in_range):
    """Like ``cp_async_16``, but when ``in_range`` is false write 16 zero bytes and read
    nothing (``src[0]`` is passed as a harmless address). One instruction either way."""
    _cp_async_16_zfill(
        dst_shared,
        _ffi.from_buffer(src),
        src_index if in_range else 0,
        types.uint32(16) if in_range else types.uint32(0),
    )


@cuda.jit(device=True, forceinline=True)
def global_address(array):
    """Byte address (int64) of element 0 of a 1-D uint16 global array, for the ``*_at`` moves:
    a kernel keeps one address a thread and steps it by byte offsets."""
    return _global_address_u16(_ffi.from_buffer(array))


@cuda.jit(device=True, forceinline=True)
def cp_async_16_at(dst_shared, src_address):
    """Copy 16 bytes from the global byte address ``src_address`` (int64, 16-byte aligned)
    to ``dst_shared``."""
    _cp_async_16_at(dst_shared, src_address)


@cuda.jit(device=True, forceinline=True)
def cp_async_16_zfill_at(dst_shared, src_address, in_range):
    """``cp_async_16_at`` when ``in_range``; otherwise write 16 zero bytes and read nothing
    (``src_address`` must still be a valid address: pass a harmless one)."""
    _cp_async_16_zfill_at(dst_shared, src_address, types.uint32(16) if in_range else types.uint32(0))


@cuda.jit(device=True, forceinline=True)
def ld_shared_v4(regs, src_shared):
    """Load 16 bytes at shared address ``src_shared`` into ``regs[0:4]`` (uint32)."""
    _ld_shared_v4(_ffi.from_buffer(regs), src_shared)


@cuda.jit(device=True, forceinline=True)
def st_shared_v4(dst_shared, regs):
    """Store ``regs[0:4]`` (uint32) as 16 bytes at shared address ``dst_shared``."""
    _st_shared_v4(dst_shared, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def st_global_v4(dst, dst_index, regs):
    """Store ``regs[0:4]`` (uint32) as 8 uint16 at ``dst[dst_index:]`` (global, 1-D;
    not bounds-checked)."""
    _st_global_v4(_ffi.from_buffer(dst), dst_index, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def ld_global_nc_v4_at(regs, src_address):
    """Load 16 bytes at the global byte address ``src_address`` (int64, 16-byte aligned) into
    ``regs[0:4]`` (uint32) through the read-only path: only for memory no thread writes while
    the kernel runs."""
    _ld_global_nc_v4_at(_ffi.from_buffer(regs), src_address)


@cuda.jit(device=True, forceinline=True)
def st_global_v4_at(dst_address, regs):
    """Store ``regs[0:4]`` (uint32) as 16 bytes at the global byte address ``dst_address``
    (int64, 16-byte aligned)."""
    _st_global_v4_at(dst_address, _ffi.from_buffer(regs))
