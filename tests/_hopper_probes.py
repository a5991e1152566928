"""Hopper (sm_90a) probe kernels: each exercises one wgmma / TMA / mbarrier / stmatrix /
setmaxnreg helper on data laid out by the host (``test_ptx_hopper_gpu.py`` runs them on a GPU,
``test_inspect_hopper_offline.py`` checks their SASS offline)."""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, types, uint32

from numbaflash import ptx
from numbaflash.demos.hopper_gemm import COPY_SHARED_WORDS, WARPGROUP
from numbaflash.ptx import hopper as hp

PROBE_WAIT_TRIES = 4096


@cuda.jit(device=True, forceinline=True)
def wait_bounded(bar, parity):
    """``mbarrier_wait_parity`` that gives up (returns False) after ``PROBE_WAIT_TRIES`` tries,
    so that a broken copy fails a test instead of hanging the GPU."""
    for _ in range(PROBE_WAIT_TRIES):
        if hp.mbarrier_try_wait_parity(bar, parity):
            return True
    return False

# ---------------------------------------------------------------------------------------------
# Probes: one helper each, on shared-memory images and fragments laid out by the host
# ---------------------------------------------------------------------------------------------

PROBE_K = 64
PROBE_K_STEPS = 4  # k16 steps
PROBE_A_BYTES = 64 * PROBE_K * 2  # the A image comes first in shared memory
PROBE_SHARED_WORDS = 10240  # 8 KB of A + up to 32 KB of B


@functools.cache
def make_wgmma_probe(
    n: int, dtype: str, a_from_registers: bool = False, trans_b: bool = False, commit_each: bool = False
):
    """Kernel ``(a_img, b_img, a_frag, params, c_init, out, descs)`` running four wgmma
    m64nNk16 steps (K = 64) on one warpgroup.

    a_img / b_img: uint32 words of the shared-memory images of A (64 x 64) and B (64 x N),
    copied to a 1024-aligned buffer (A at byte 0, B at byte 8192); a_frag: uint32 (128, 4, 4),
    thread t's A fragments per k-step (RS form); params: int64 [a_lbo, a_sbo, a_swizzle,
    b_lbo, b_sbo, b_swizzle, accumulate, a_step0..3, b_step0..3] (steps: byte offsets of the
    k-steps' start addresses); c_init / out: float32 (128, N/2) accumulators per thread
    (accumulate = 0: start from NaN with scale-d = 0 on the first step); descs: uint64[3], the
    base descriptors built on the device and the buffer's address mod 1024. ``commit_each``:
    commit a group per step, then wait_group 3, 2, 1, 0.
    """
    nacc = n // 2
    fence_acc = hp.wgmma_fence_operand(n)
    if a_from_registers:
        mma_rs = hp.wgmma_rs(n, dtype, trans_b)

        @cuda.jit(device=True, forceinline=True)
        def issue(acc, frag, desc_a, desc_b, scale_d):
            mma_rs(acc, frag, desc_b, scale_d)
    else:
        mma_ss = hp.wgmma_ss(n, dtype, trans_b)

        @cuda.jit(device=True, forceinline=True)
        def issue(acc, frag, desc_a, desc_b, scale_d):
            mma_ss(acc, desc_a, desc_b, scale_d)

    def wgmma_probe(a_img, b_img, a_frag, params, c_init, out, descs):
        smem = cuda.shared.array(PROBE_SHARED_WORDS, types.uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(tid, a_img.size, WARPGROUP):
            smem[i] = a_img[i]
        for i in range(tid, b_img.size, WARPGROUP):
            smem[PROBE_A_BYTES // 4 + i] = b_img[i]
        hp.fence_proxy_async_shared_cta()  # generic-proxy writes -> wgmma (async proxy) reads
        cuda.syncthreads()

        base = ptx.shared_address_u32(smem)
        desc_a = hp.smem_descriptor(base, params[0], params[1], params[2])
        desc_b = hp.smem_descriptor(base + PROBE_A_BYTES, params[3], params[4], params[5])
        if tid == 0:
            descs[0] = desc_a
            descs[1] = desc_b
            descs[2] = base % 1024  # the swizzled layouts assume a 1024-aligned buffer
        accumulate = params[6] != 0
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = c_init[tid, i] if accumulate else float32(np.nan)
        frag = cuda.local.array((PROBE_K_STEPS, 4), uint32)
        for s in range(PROBE_K_STEPS):
            for j in range(4):
                frag[s, j] = a_frag[tid, s, j]

        fence_acc(acc)
        hp.wgmma_fence()
        for s in range(PROBE_K_STEPS):
            scale_d = 1 if (accumulate or s > 0) else 0
            issue(acc, frag[s], hp.descriptor_add(desc_a, params[7 + s]),
                  hp.descriptor_add(desc_b, params[11 + s]), scale_d)
            if commit_each:
                hp.wgmma_commit_group()
        if commit_each:
            hp.wgmma_wait_group_3()
            hp.wgmma_wait_group_2()
            hp.wgmma_wait_group_1()
        else:
            hp.wgmma_commit_group()
        hp.wgmma_wait_group_0()
        fence_acc(acc)
        for i in range(nacc):
            out[tid, i] = acc[i]

    form = "rs" if a_from_registers else "ss"
    wgmma_probe.__name__ = (
        f"wgmma_probe_{form}_n{n}_{dtype}" + ("_tb" if trans_b else "") + ("_groups" if commit_each else "")
    )
    return wgmma_probe


WGMMA_PROBE_ARGTYPES = (
    types.uint32[::1],
    types.uint32[::1],
    types.uint32[:, :, ::1],
    types.int64[::1],
    types.float32[:, ::1],
    types.float32[:, ::1],
    types.uint64[::1],
)


def mbarrier_probe(out):
    """Kernel ``(out)``, one warpgroup; out uint32 (128, 5) records try_wait results of an
    arrival-count barrier (count 128) through phases 0 and 1. (Transaction counts are
    exercised with TMA by ``make_tma_load_probe``.)"""
    bars = cuda.shared.array(1, types.uint64)
    tid = cuda.threadIdx.x
    b0 = ptx.shared_address_u64(bars)
    if tid == 0:
        hp.mbarrier_init(b0, WARPGROUP)
        hp.fence_mbarrier_init()
    cuda.syncthreads()
    out[tid, 0] = hp.mbarrier_try_wait_parity(b0, 0)  # phase 0 open: nobody arrived
    out[tid, 1] = hp.mbarrier_try_wait_parity(b0, 1)  # the phase before phase 0 reads as done
    cuda.syncthreads()
    hp.mbarrier_arrive(b0)
    wait_bounded(b0, 0)
    out[tid, 2] = hp.mbarrier_try_wait_parity(b0, 0)
    out[tid, 3] = hp.mbarrier_try_wait_parity(b0, 1)  # phase 1 open
    cuda.syncthreads()
    hp.mbarrier_arrive(b0)
    wait_bounded(b0, 1)
    out[tid, 4] = hp.mbarrier_try_wait_parity(b0, 1)


MBARRIER_PROBE_ARGTYPES = (types.uint32[:, ::1],)


@cuda.jit(device=True, forceinline=True)
def _load_box_2d(dst, tmap, bar, c):
    hp.tma_load_2d(dst, tmap, bar, c[0], c[1])


@cuda.jit(device=True, forceinline=True)
def _load_box_3d(dst, tmap, bar, c):
    hp.tma_load_3d(dst, tmap, bar, c[0], c[1], c[2])


@cuda.jit(device=True, forceinline=True)
def _load_box_4d(dst, tmap, bar, c):
    hp.tma_load_4d(dst, tmap, bar, c[0], c[1], c[2], c[3])


@cuda.jit(device=True, forceinline=True)
def _store_box_2d(tmap, src, c):
    hp.tma_store_2d(tmap, src, c[0], c[1])


@cuda.jit(device=True, forceinline=True)
def _store_box_3d(tmap, src, c):
    hp.tma_store_3d(tmap, src, c[0], c[1], c[2])


@cuda.jit(device=True, forceinline=True)
def _store_box_4d(tmap, src, c):
    hp.tma_store_4d(tmap, src, c[0], c[1], c[2], c[3])


_LOAD_BOX = {2: _load_box_2d, 3: _load_box_3d, 4: _load_box_4d}
_STORE_BOX = {2: _store_box_2d, 3: _store_box_3d, 4: _store_box_4d}


@functools.cache
def make_tma_load_probe(rank: int):
    """Kernel ``(tmap, coords, box_bytes, flags, out, status)``: thread 0 loads the box at ``coords``
    (int32, innermost first) into a 1024-aligned buffer, completing on an mbarrier; then the
    block (128 threads) copies the raw shared image (``box_bytes``) to ``out`` (uint32).
    flags: 1 = fence the map with fence.proxy.tensormap acquire first, 2 = prefetch it first,
    4 = arm the barrier with expect_tx + arrive instead of arrive_expect_tx. status[0] = 1 if
    the mbarrier wait timed out; status[1] = try_wait result after arming, before the copy."""
    load_box = _LOAD_BOX[rank]

    def tma_load_probe(tmap, coords, box_bytes, flags, out, status):
        smem = cuda.shared.array(COPY_SHARED_WORDS, types.uint32, alignment=1024)
        bar = cuda.shared.array(1, types.uint64)
        tid = cuda.threadIdx.x
        b = ptx.shared_address_u64(bar)
        if tid == 0:
            hp.mbarrier_init(b, 1)
            hp.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            if flags & 1:
                hp.fence_proxy_tensormap_acquire(tmap)
            if flags & 2:
                hp.tma_prefetch_descriptor(tmap)
            if flags & 4:
                hp.mbarrier_expect_tx(b, box_bytes)
                hp.mbarrier_arrive(b)
            else:
                hp.mbarrier_arrive_expect_tx(b, box_bytes)
            status[1] = hp.mbarrier_try_wait_parity(b, 0)  # bytes outstanding: phase open
            load_box(ptx.shared_address_u32(smem), tmap, b, coords)
        if not wait_bounded(b, 0):
            status[0] = 1
        for i in range(tid, box_bytes // 4, WARPGROUP):
            out[i] = smem[i]

    tma_load_probe.__name__ = f"tma_load_probe_{rank}d"
    return tma_load_probe


TMA_LOAD_PROBE_ARGTYPES = (
    types.uint64[::1], types.int32[::1], types.int64, types.int64, types.uint32[::1], types.int32[::1],
)


@functools.cache
def make_tma_store_probe(rank: int):
    """Kernel ``(tmap, coords, src)``: the block writes the shared image ``src`` (uint32) with
    ordinary stores (128 threads), fences it to the async proxy, and thread 0 stores it as the box at
    ``coords`` of ``tmap`` with TMA."""
    store_box = _STORE_BOX[rank]

    def tma_store_probe(tmap, coords, src):
        smem = cuda.shared.array(COPY_SHARED_WORDS, types.uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(tid, src.size, WARPGROUP):
            smem[i] = src[i]
        hp.fence_proxy_async_shared_cta()
        cuda.syncthreads()
        if tid == 0:
            store_box(tmap, ptx.shared_address_u32(smem), coords)
            hp.tma_store_commit_group()
            hp.tma_store_wait_group_0()

    tma_store_probe.__name__ = f"tma_store_probe_{rank}d"
    return tma_store_probe


TMA_STORE_PROBE_ARGTYPES = (types.uint64[::1], types.int32[::1], types.uint32[::1])

STMATRIX_REGION_BYTES = 512  # 32 rows of 16 bytes per variant
STMATRIX_SHARED_WORDS = 6 * STMATRIX_REGION_BYTES // 4


def stmatrix_probe(regs, rows, out):
    """Kernel ``(regs, rows, out)``, one warp: lane l holds ``regs[l, 0:4]`` and gives the
    address of 16-byte row ``rows[l]``; the six variants (x1, x2, x4, then transposed) store
    into six zeroed 512-byte regions copied to ``out`` (uint32 (6, 128))."""
    smem = cuda.shared.array(STMATRIX_SHARED_WORDS, types.uint32, alignment=16)
    lane = cuda.threadIdx.x
    for i in range(STMATRIX_SHARED_WORDS // 32):
        smem[lane + 32 * i] = 0
    r = cuda.local.array(4, uint32)
    for j in range(4):
        r[j] = regs[lane, j]
    cuda.syncthreads()
    addr = ptx.shared_address_u32(smem) + rows[lane] * 16
    hp.stmatrix_x1(addr, r)
    hp.stmatrix_x2(addr + STMATRIX_REGION_BYTES, r)
    hp.stmatrix_x4(addr + 2 * STMATRIX_REGION_BYTES, r)
    hp.stmatrix_x1_trans(addr + 3 * STMATRIX_REGION_BYTES, r)
    hp.stmatrix_x2_trans(addr + 4 * STMATRIX_REGION_BYTES, r)
    hp.stmatrix_x4_trans(addr + 5 * STMATRIX_REGION_BYTES, r)
    cuda.syncthreads()
    for v in range(6):
        for i in range(4):
            out[v, lane + 32 * i] = smem[v * 128 + lane + 32 * i]


STMATRIX_PROBE_ARGTYPES = (types.uint32[:, ::1], types.int32[::1], types.uint32[:, ::1])

SETMAXNREG_THREADS = 384
SETMAXNREG_LAUNCH_BOUNDS = (SETMAXNREG_THREADS, 1)  # register cap 168 at entry


@functools.cache
def make_setmaxnreg_probe(dec: int = 24, inc: int = 240):
    """Kernel ``(out)`` for 384 threads (compile with ``SETMAXNREG_LAUNCH_BOUNDS``): warpgroup
    0 lowers its budget to ``dec`` registers, warpgroups 1 and 2 raise theirs to ``inc``
    (FlashAttention-3's producer/consumer split), then every thread writes out[t] = 3t + wg."""
    lower = getattr(hp, f"setmaxnreg_dec_{dec}")
    raise_ = getattr(hp, f"setmaxnreg_inc_{inc}")

    def setmaxnreg_probe(out):
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        if wg == 0:
            lower()
            out[tid] = 3 * tid
        else:
            raise_()
            out[tid] = 3 * tid + wg

    setmaxnreg_probe.__name__ = f"setmaxnreg_probe_dec{dec}_inc{inc}"
    return setmaxnreg_probe


SETMAXNREG_PROBE_ARGTYPES = (types.int32[::1],)


def registered() -> dict:
    """name -> (python kernel function, argument types, architectures) for offline inspection."""
    hopper = ("sm_90a",)
    return {
        "wgmma_probe_ss_n256_f16": (make_wgmma_probe(256, "f16"), WGMMA_PROBE_ARGTYPES, hopper),
        "wgmma_probe_rs_n256_bf16_tb": (
            make_wgmma_probe(256, "bf16", True, True), WGMMA_PROBE_ARGTYPES, hopper),
        "mbarrier_probe": (mbarrier_probe, MBARRIER_PROBE_ARGTYPES, hopper),
        "tma_load_probe_2d": (make_tma_load_probe(2), TMA_LOAD_PROBE_ARGTYPES, hopper),
        "tma_load_probe_4d": (make_tma_load_probe(4), TMA_LOAD_PROBE_ARGTYPES, hopper),
        "tma_store_probe_2d": (make_tma_store_probe(2), TMA_STORE_PROBE_ARGTYPES, hopper),
        "stmatrix_probe": (stmatrix_probe, STMATRIX_PROBE_ARGTYPES, hopper),
    }
