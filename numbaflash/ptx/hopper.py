"""Hopper (sm_90 / sm_90a) helpers: wgmma, shared-memory matrix descriptors, mbarrier, TMA,
stmatrix, proxy fences, setmaxnreg and named barriers (``ptx/wgmma.cu``, ``mbarrier.cu``,
``tma.cu``, ``stmatrix.cu``, ``fence.cu``, ``barrier.cu``).

Conventions (the same as the sm_80 helpers):

* shared-memory operands are 32-bit shared-window byte addresses (``uint32``), obtained with
  ``shared_address_u16(array)`` etc. plus a byte offset;
* register operands are local arrays (or rows of one), passed as pointers internally;
* a tensor map is a 1-D ``uint64[16]`` device array (one row of the array made by
  ``numbaflash.runtime.tensor_map.tensor_maps_to_device``), 64-byte aligned in global memory;
* TMA coordinates are ``int32`` element indices, innermost dimension first.

wgmma helpers are made per shape by ``wgmma_ss(n, dtype, trans_b)`` and
``wgmma_rs(n, dtype, trans_b)`` (host-side factories, called where the kernel is built).
"""

from __future__ import annotations

import functools

import cffi
import numpy as np
from numba import cuda, types

from ._declare import declare, f32p, u32p, u64p

_ffi = cffi.FFI()
_u32 = types.uint32
_u64 = types.uint64
_i32 = types.int32
_void = types.void

# ---------------------------------------------------------------------------------------------
# wgmma: fence, commit, wait, mma_async
# ---------------------------------------------------------------------------------------------

WGMMA_N = (8, 16, 32, 48, 64, 80, 96, 128, 176, 192, 256)
"""The N of every wgmma m64nNk16 shape bound here (accumulators per thread: N / 2)."""

wgmma_fence = declare("wgmma", "wgmma_fence", _void())
wgmma_fence.__doc__ = "wgmma.fence: order earlier register/shared accesses before the next mma_async."
wgmma_commit_group = declare("wgmma", "wgmma_commit_group", _void())
wgmma_commit_group.__doc__ = "wgmma.commit_group: close the group of mma_async issued since the last commit."
wgmma_wait_group_0 = declare("wgmma", "wgmma_wait_group_0", _void())
wgmma_wait_group_1 = declare("wgmma", "wgmma_wait_group_1", _void())
wgmma_wait_group_2 = declare("wgmma", "wgmma_wait_group_2", _void())
wgmma_wait_group_3 = declare("wgmma", "wgmma_wait_group_3", _void())
for _n, _f in enumerate((wgmma_wait_group_0, wgmma_wait_group_1, wgmma_wait_group_2, wgmma_wait_group_3)):
    _f.__doc__ = f"wgmma.wait_group {_n}: wait until at most {_n} committed groups are pending."

_DTYPES = ("f16", "bf16", "e4m3")


def _check_shape(n: int, dtype: str) -> None:
    if n not in WGMMA_N:
        raise ValueError(f"wgmma m64n{n}k16 is not bound; N must be one of {WGMMA_N}")
    if dtype not in _DTYPES:
        raise ValueError(f"wgmma input type must be one of {_DTYPES}, not {dtype!r}")


def _wgmma_name(n: int, dtype: str, form: str) -> str:
    """The helper's name in ptx/wgmma.cu: m64nNk16 for the 16-bit types, m64nNk32 for e4m3 (a
    k-step is 32 bytes of a K-major row either way)."""
    k = 32 if dtype == "e4m3" else 16
    return f"wgmma_m64n{n}k{k}_f32_{dtype}_{form}"


def wgmma_ss(n: int, dtype: str = "f16", trans_b: bool = False, trans_a: bool = False):
    """Device function ``mma(acc, desc_a, desc_b, scale_d)`` for wgmma m64nNk16, A and B from
    shared memory: ``acc[0:n/2]`` (float32, in place) = A(64x16) @ B(16xN) + (acc if scale_d).

    ``desc_a``/``desc_b`` are uint64 matrix descriptors (``smem_descriptor``); A is K-major,
    or MN-major when ``trans_a`` (bound only together with ``trans_b``); B is K-major, or
    MN-major when ``trans_b``. ``scale_d`` is 0 (ignore acc) or 1. ``dtype`` "e4m3": m64nNk32
    (A 64x32, B 32xN), both operands K-major (8-bit types take no transpose).
    """
    _check_shape(n, dtype)
    if dtype == "e4m3" and (trans_a or trans_b):
        raise ValueError("e4m3 wgmma operands are K-major only (no trans_a / trans_b)")
    if trans_a and not trans_b:
        raise ValueError("wgmma_ss binds an MN-major A only with an MN-major B (trans_a needs trans_b)")
    return _wgmma_ss(n, dtype, bool(trans_b), bool(trans_a))


@functools.cache
def _wgmma_ss(n: int, dtype: str, trans_b: bool, trans_a: bool = False):
    name = _wgmma_name(n, dtype, "ss") + ("_ta" if trans_a else "") + ("_tb" if trans_b else "")
    fn = declare("wgmma", name, _void(f32p, _u64, _u64, _u32))

    @cuda.jit(device=True, forceinline=True)
    def mma(acc, desc_a, desc_b, scale_d):
        fn(_ffi.from_buffer(acc), desc_a, desc_b, scale_d)

    return mma


def wgmma_rs(n: int, dtype: str = "f16", trans_b: bool = False):
    """Device function ``mma(acc, a, desc_b, scale_d)`` for wgmma m64nNk16 with A from
    registers: ``a[0:4]`` (uint32, packed 16-bit pairs) is this thread's A fragment, laid out
    like the mma.sync m16n8k16 A fragment for rows 16*(warp%4) .. +15. B from shared memory
    as in ``wgmma_ss``. ``dtype`` "e4m3": m64nNk32, ``a[0:4]`` four e4m3 each in the mma.sync
    m16n8k32 A-fragment layout, B K-major."""
    _check_shape(n, dtype)
    if dtype == "e4m3" and trans_b:
        raise ValueError("e4m3 wgmma operands are K-major only (no trans_b)")
    return _wgmma_rs(n, dtype, bool(trans_b))


@functools.cache
def _wgmma_rs(n: int, dtype: str, trans_b: bool):
    name = _wgmma_name(n, dtype, "rs") + ("_tb" if trans_b else "")
    fn = declare("wgmma", name, _void(f32p, u32p, _u64, _u32))

    @cuda.jit(device=True, forceinline=True)
    def mma(acc, a, desc_b, scale_d):
        fn(_ffi.from_buffer(acc), _ffi.from_buffer(a), desc_b, scale_d)

    return mma


@functools.cache
def wgmma_fence_operand(n: int):
    """Device function ``fence(acc)`` for the n/2 accumulators of an m64nNk16 wgmma: an empty
    asm that reads and writes them, so the compiler keeps accumulator accesses on their side
    of wgmma fence/commit/wait (call it before the first mma and after the wait)."""
    _check_shape(n, "f16")
    fn = declare("wgmma", f"wgmma_fence_operand_{n // 2}", _void(f32p))

    @cuda.jit(device=True, forceinline=True)
    def fence(acc):
        fn(_ffi.from_buffer(acc))

    return fence


# ---------------------------------------------------------------------------------------------
# Shared-memory matrix descriptors (plain integer arithmetic; the same code runs on the host)
# ---------------------------------------------------------------------------------------------

SWIZZLE_NONE = 0
SWIZZLE_128B = 1
SWIZZLE_64B = 2
SWIZZLE_32B = 3


def encode_smem_descriptor(address, leading_byte_offset, stride_byte_offset, swizzle):
    """64-bit wgmma matrix descriptor (PTX ISA "Matrix Descriptor Format").

    bits 0-13 start address >> 4, bits 16-29 leading-dimension byte offset >> 4,
    bits 32-45 stride-dimension byte offset >> 4, bits 49-51 base offset (0: the
    swizzle pattern is aligned, i.e. 1024-byte aligned tiles for 128B), bits 62-63
    swizzle (``SWIZZLE_NONE``/``SWIZZLE_128B``/``SWIZZLE_64B``/``SWIZZLE_32B``).
    Runs on the host and, as ``smem_descriptor``, on the device.
    """
    d = np.uint64((address & 0x3FFFF) >> 4)
    d |= np.uint64((leading_byte_offset & 0x3FFFF) >> 4) << np.uint64(16)
    d |= np.uint64((stride_byte_offset & 0x3FFFF) >> 4) << np.uint64(32)
    d |= np.uint64(swizzle & 3) << np.uint64(62)
    return d


smem_descriptor = cuda.jit(device=True, forceinline=True)(encode_smem_descriptor)


@cuda.jit(device=True, forceinline=True)
def smem_descriptor_k_sw128(address):
    """Descriptor of a K-major 16-bit tile in the 128B-swizzle layout that TMA writes with a
    64-element (128-byte) inner box: row r at byte 128*r, 8-row atoms 1024 bytes apart (SBO);
    1024-byte aligned. Advance K by 16 elements with ``descriptor_add(desc, 32)``."""
    return smem_descriptor(address, 16, 1024, SWIZZLE_128B)


@cuda.jit(device=True, forceinline=True)
def smem_descriptor_mn_sw128(address, mn_chunk_bytes):
    """Descriptor of an MN-major 16-bit tile in the 128B-swizzle layout: each k row holds 64
    MN elements (128 bytes), 8-row atoms 1024 bytes apart (SBO); the next 64 MN elements start
    ``mn_chunk_bytes`` later (LBO; e.g. rows*128 for a tile loaded as 64-wide TMA boxes).
    Advance K by 16 rows with ``descriptor_add(desc, 2048)``."""
    return smem_descriptor(address, mn_chunk_bytes, 1024, SWIZZLE_128B)


@cuda.jit(device=True, forceinline=True)
def smem_descriptor_k_sw64(address):
    """Descriptor of a K-major 16-bit tile in the 64B-swizzle layout that TMA writes with a
    32-element (64-byte) inner box: row r at byte 64*r, 8-row atoms 512 bytes apart (SBO);
    512-byte aligned. Advance K by 16 elements with ``descriptor_add(desc, 32)`` (two k-steps
    per 64-byte row)."""
    return smem_descriptor(address, 16, 512, SWIZZLE_64B)


@cuda.jit(device=True, forceinline=True)
def smem_descriptor_mn_sw64(address, mn_chunk_bytes):
    """Descriptor of an MN-major 16-bit tile in the 64B-swizzle layout: each k row holds 32
    MN elements (64 bytes), 8-row atoms 512 bytes apart (SBO); the next 32 MN elements start
    ``mn_chunk_bytes`` later (LBO; rows*64 for a tile loaded as 32-wide TMA boxes).
    Advance K by 16 rows with ``descriptor_add(desc, 1024)``."""
    return smem_descriptor(address, mn_chunk_bytes, 512, SWIZZLE_64B)


@cuda.jit(device=True, forceinline=True)
def descriptor_add(desc, byte_offset):
    """Move a descriptor's start address by ``byte_offset`` bytes (a multiple of 16)."""
    return desc + np.uint64(byte_offset >> 4)


# ---------------------------------------------------------------------------------------------
# mbarrier
# ---------------------------------------------------------------------------------------------

mbarrier_init = declare("mbarrier", "mbarrier_init", _void(_u32, _u32))
mbarrier_init.__doc__ = "mbarrier_init(bar, count): initialise the barrier at shared address bar."
fence_mbarrier_init = declare("mbarrier", "fence_mbarrier_init", _void())
fence_mbarrier_init.__doc__ = "fence.mbarrier_init.release.cluster: publish initialised barriers."
mbarrier_arrive = declare("mbarrier", "mbarrier_arrive", _void(_u32))
mbarrier_arrive.__doc__ = "mbarrier_arrive(bar): one arrival."
mbarrier_arrive_expect_tx = declare("mbarrier", "mbarrier_arrive_expect_tx", _void(_u32, _u32))
mbarrier_arrive_expect_tx.__doc__ = "mbarrier_arrive_expect_tx(bar, nbytes): expect nbytes more, and arrive."
mbarrier_expect_tx = declare("mbarrier", "mbarrier_expect_tx", _void(_u32, _u32))
mbarrier_expect_tx.__doc__ = (
    "mbarrier_expect_tx(bar, nbytes): expect nbytes more, without arriving "
    "(prefer the single atomic mbarrier_arrive_expect_tx)."
)
_try_wait_parity = declare("mbarrier", "mbarrier_try_wait_parity", _u32(_u32, _u32))


@cuda.jit(device=True, forceinline=True)
def mbarrier_try_wait_parity(bar, parity):
    """True when the phase of the given parity (0/1) of the barrier at ``bar`` has completed;
    False after a time limit. A fresh barrier is in phase 0: parity 1 reads as completed."""
    return _try_wait_parity(bar, parity) != 0


@cuda.jit(device=True, forceinline=True)
def mbarrier_wait_parity(bar, parity):
    """Block until the phase of the given parity of the barrier at ``bar`` has completed."""
    while _try_wait_parity(bar, parity) == 0:
        pass


# ---------------------------------------------------------------------------------------------
# TMA (cp.async.bulk.tensor)
# ---------------------------------------------------------------------------------------------

_prefetch_tensormap = declare("tma", "prefetch_tensormap", _void(u64p))
_load_2d = declare("tma", "tma_load_2d", _void(_u32, u64p, _u32, _i32, _i32))
_load_3d = declare("tma", "tma_load_3d", _void(_u32, u64p, _u32, _i32, _i32, _i32))
_load_4d = declare("tma", "tma_load_4d", _void(_u32, u64p, _u32, _i32, _i32, _i32, _i32))
_store_2d = declare("tma", "tma_store_2d", _void(u64p, _u32, _i32, _i32))
_store_3d = declare("tma", "tma_store_3d", _void(u64p, _u32, _i32, _i32, _i32))
_store_4d = declare("tma", "tma_store_4d", _void(u64p, _u32, _i32, _i32, _i32, _i32))
tma_store_commit_group = declare("tma", "cp_async_bulk_commit_group", _void())
tma_store_commit_group.__doc__ = "cp.async.bulk.commit_group: close the group of TMA stores issued so far."
tma_store_wait_group_0 = declare("tma", "cp_async_bulk_wait_group_0", _void())
tma_store_wait_group_0.__doc__ = "cp.async.bulk.wait_group 0: all committed TMA stores are complete."
tma_store_wait_group_read_0 = declare("tma", "cp_async_bulk_wait_group_read_0", _void())
tma_store_wait_group_read_0.__doc__ = "cp.async.bulk.wait_group.read 0: their shared sources may be reused."
bulk_reduce_add_f32 = declare("tma", "bulk_reduce_add_f32", _void(types.int64, _u32, _u32))
bulk_reduce_add_f32.__doc__ = ("bulk_reduce_add_f32(global_address, shared_address, nbytes): global "
                               "float32 += shared (cp.reduce.async.bulk .add.f32; committed and waited "
                               "for like a TMA store).")


@cuda.jit(device=True, forceinline=True)
def tma_prefetch_descriptor(tmap):
    """prefetch.tensormap: bring the tensor map ``tmap`` (uint64[16] in global) into cache."""
    _prefetch_tensormap(_ffi.from_buffer(tmap))


@cuda.jit(device=True, forceinline=True)
def tma_load_2d(dst, tmap, bar, c0, c1):
    """One thread copies the box at (c0 innermost, c1) of ``tmap`` to shared address ``dst``;
    completion counts the box bytes on the mbarrier at ``bar`` (arm it with expect_tx)."""
    _load_2d(dst, _ffi.from_buffer(tmap), bar, c0, c1)


@cuda.jit(device=True, forceinline=True)
def tma_load_3d(dst, tmap, bar, c0, c1, c2):
    """3-D ``tma_load_2d``."""
    _load_3d(dst, _ffi.from_buffer(tmap), bar, c0, c1, c2)


@cuda.jit(device=True, forceinline=True)
def tma_load_4d(dst, tmap, bar, c0, c1, c2, c3):
    """4-D ``tma_load_2d``."""
    _load_4d(dst, _ffi.from_buffer(tmap), bar, c0, c1, c2, c3)


@cuda.jit(device=True, forceinline=True)
def tma_store_2d(tmap, src, c0, c1):
    """One thread copies the box at shared address ``src`` to (c0, c1) of ``tmap`` (elements
    outside the tensor are not written). Shared data written by ordinary stores needs
    ``fence_proxy_async_shared_cta`` + a barrier first; then commit and wait."""
    _store_2d(_ffi.from_buffer(tmap), src, c0, c1)


@cuda.jit(device=True, forceinline=True)
def tma_store_3d(tmap, src, c0, c1, c2):
    """3-D ``tma_store_2d``."""
    _store_3d(_ffi.from_buffer(tmap), src, c0, c1, c2)


@cuda.jit(device=True, forceinline=True)
def tma_store_4d(tmap, src, c0, c1, c2, c3):
    """4-D ``tma_store_2d``."""
    _store_4d(_ffi.from_buffer(tmap), src, c0, c1, c2, c3)


# ---------------------------------------------------------------------------------------------
# stmatrix
# ---------------------------------------------------------------------------------------------

_stsm_sig = _void(_u32, u32p)
_stsm_x1 = declare("stmatrix", "stmatrix_x1", _stsm_sig)
_stsm_x2 = declare("stmatrix", "stmatrix_x2", _stsm_sig)
_stsm_x4 = declare("stmatrix", "stmatrix_x4", _stsm_sig)
_stsm_x1_trans = declare("stmatrix", "stmatrix_x1_trans", _stsm_sig)
_stsm_x2_trans = declare("stmatrix", "stmatrix_x2_trans", _stsm_sig)
_stsm_x4_trans = declare("stmatrix", "stmatrix_x4_trans", _stsm_sig)


@cuda.jit(device=True, forceinline=True)
def stmatrix_x1(address, regs):
    """Store one 8x8 16-bit matrix from ``regs[0]`` of each lane; lanes 0-7 give row addresses."""
    _stsm_x1(address, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def stmatrix_x2(address, regs):
    """Store two 8x8 matrices from ``regs[0:2]``; lanes 0-15 give row addresses."""
    _stsm_x2(address, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def stmatrix_x4(address, regs):
    """Store four 8x8 matrices from ``regs[0:4]``; lanes 8i..8i+7 give matrix i's rows."""
    _stsm_x4(address, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def stmatrix_x1_trans(address, regs):
    """``stmatrix_x1``, each matrix stored transposed."""
    _stsm_x1_trans(address, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def stmatrix_x2_trans(address, regs):
    """``stmatrix_x2``, each matrix stored transposed."""
    _stsm_x2_trans(address, _ffi.from_buffer(regs))


@cuda.jit(device=True, forceinline=True)
def stmatrix_x4_trans(address, regs):
    """``stmatrix_x4``, each matrix stored transposed."""
    _stsm_x4_trans(address, _ffi.from_buffer(regs))


# ---------------------------------------------------------------------------------------------
# Fences and register reallocation
# ---------------------------------------------------------------------------------------------

fence_proxy_async_shared_cta = declare("fence", "fence_proxy_async_shared_cta", _void())
fence_proxy_async_shared_cta.__doc__ = (
    "fence.proxy.async.shared::cta: make this thread's ordinary shared-memory writes visible to "
    "wgmma/TMA (async proxy) after the next barrier."
)
fence_acq_rel_cta_after = declare("fence", "fence_acq_rel_cta_after", _void(types.float32, types.float32))
fence_acq_rel_cta_after.__doc__ = (
    "fence.acq_rel.cta (MEMBAR.ALL.CTA) once its two float32 arguments are computed; ptxas does "
    "not move a wgmma wait above it, so it pins a wait below the work that made them."
)
_tensormap_acquire = declare("fence", "fence_proxy_tensormap_acquire", _void(u64p))


@cuda.jit(device=True, forceinline=True)
def fence_proxy_tensormap_acquire(tmap):
    """fence.proxy.tensormap::generic.acquire.gpu on the 128-byte map ``tmap`` (only needed
    for maps written after the kernel started)."""
    _tensormap_acquire(_ffi.from_buffer(tmap))


setmaxnreg_dec_24 = declare("fence", "setmaxnreg_dec_24", _void())
setmaxnreg_dec_32 = declare("fence", "setmaxnreg_dec_32", _void())
setmaxnreg_dec_40 = declare("fence", "setmaxnreg_dec_40", _void())
setmaxnreg_dec_56 = declare("fence", "setmaxnreg_dec_56", _void())
setmaxnreg_inc_160 = declare("fence", "setmaxnreg_inc_160", _void())
setmaxnreg_inc_224 = declare("fence", "setmaxnreg_inc_224", _void())
setmaxnreg_inc_232 = declare("fence", "setmaxnreg_inc_232", _void())
setmaxnreg_inc_240 = declare("fence", "setmaxnreg_inc_240", _void())

# ---------------------------------------------------------------------------------------------
# Named barriers (ptx/barrier.cu): synchronise a subset of warps, or signal without waiting
# ---------------------------------------------------------------------------------------------

named_barrier_sync = declare("barrier", "named_barrier_sync", _void(_u32, _u32))
named_barrier_sync.__doc__ = (
    "named_barrier_sync(id, count): bar.sync id, count: arrive at barrier id (1..15; 0 is "
    "syncthreads) and wait until count threads (a multiple of 32) have arrived."
)
named_barrier_arrive = declare("barrier", "named_barrier_arrive", _void(_u32, _u32))
named_barrier_arrive.__doc__ = (
    "named_barrier_arrive(id, count): bar.arrive id, count: arrive at barrier id without waiting."
)

__all__ = [
    "SWIZZLE_128B",
    "SWIZZLE_32B",
    "SWIZZLE_64B",
    "SWIZZLE_NONE",
    "WGMMA_N",
    "bulk_reduce_add_f32",
    "descriptor_add",
    "encode_smem_descriptor",
    "fence_acq_rel_cta_after",
    "fence_mbarrier_init",
    "fence_proxy_async_shared_cta",
    "fence_proxy_tensormap_acquire",
    "mbarrier_arrive",
    "mbarrier_arrive_expect_tx",
    "mbarrier_expect_tx",
    "mbarrier_init",
    "mbarrier_try_wait_parity",
    "mbarrier_wait_parity",
    "named_barrier_arrive",
    "named_barrier_sync",
    "setmaxnreg_dec_24",
    "setmaxnreg_dec_32",
    "setmaxnreg_dec_40",
    "setmaxnreg_dec_56",
    "setmaxnreg_inc_160",
    "setmaxnreg_inc_224",
    "setmaxnreg_inc_232",
    "setmaxnreg_inc_240",
    "smem_descriptor",
    "smem_descriptor_k_sw128",
    "smem_descriptor_k_sw64",
    "smem_descriptor_mn_sw128",
    "smem_descriptor_mn_sw64",
    "stmatrix_x1",
    "stmatrix_x1_trans",
    "stmatrix_x2",
    "stmatrix_x2_trans",
    "stmatrix_x4",
    "stmatrix_x4_trans",
    "tma_load_2d",
    "tma_load_3d",
    "tma_load_4d",
    "tma_prefetch_descriptor",
    "tma_store_2d",
    "tma_store_3d",
    "tma_store_4d",
    "tma_store_commit_group",
    "tma_store_wait_group_0",
    "tma_store_wait_group_read_0",
    "wgmma_commit_group",
    "wgmma_fence",
    "wgmma_fence_operand",
    "wgmma_rs",
    "wgmma_ss",
    "wgmma_wait_group_0",
    "wgmma_wait_group_1",
    "wgmma_wait_group_2",
    "wgmma_wait_group_3",
]
