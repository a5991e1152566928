"""Hopper (sm_90a) demos of the wgmma / TMA / mbarrier helpers, with host launchers.

* ``wgmma_tma_gemm``: C = A @ Bᵀ (A: M x K, B: N x K, 16-bit, row-major; C float32). One
  warpgroup per 64 x 128 tile of C; K streamed in 64-wide slices by TMA (128B swizzle) into a
  two-stage shared-memory ring whose stages complete on mbarriers; wgmma m64n128k16 with A
  and B from shared memory through K-major 128B-swizzle descriptors (the S = Q Kᵀ pattern).
* ``wgmma_rs_gemm``: C = A @ B (A: 64 x K, B: K x N row-major): A fragments loaded from
  global memory into registers, B tiles by TMA as MN-major 128B-swizzle tiles, wgmma
  m64n128k16 with A from registers and B transposed (the O = P V pattern).
* ``tma_copy_2d``: a tiled copy through shared memory, TMA load then TMA store.

The one-helper probes that check each instruction live with the tests
(``tests/_hopper_probes.py``).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, types, uint32

from .. import ptx
from ..ptx import hopper as hp
from ..runtime.launch import raise_dynamic_shared_limit

WARPGROUP = 128
# ---------------------------------------------------------------------------------------------
# Demo 1: C = A @ B^T, both operands from shared memory (TMA, 2-stage ring, SS wgmma)
# ---------------------------------------------------------------------------------------------

GEMM_BM = 64
GEMM_BN = 128
GEMM_BK = 64  # one 128-byte swizzle row of 16-bit elements
GEMM_STAGES = 2
_A_TILE_BYTES = GEMM_BM * GEMM_BK * 2
_B_TILE_BYTES = GEMM_BN * GEMM_BK * 2
_GEMM_ACC = GEMM_BN // 2  # accumulators per thread
_K_STEPS = GEMM_BK // 16
_STAGE_BYTES = _A_TILE_BYTES + _B_TILE_BYTES
GEMM_SHARED_BYTES = GEMM_STAGES * _STAGE_BYTES + 1024  # + room to align to 1024 bytes


@cuda.jit(device=True, forceinline=True)
def _aligned_1024(address):
    """Round a shared address up to the 1024-byte alignment of 128B-swizzle tiles."""
    return uint32((address + 1023) & ~1023)


@cuda.jit(device=True, forceinline=True)
def store_accumulators(c, acc, row0, col0, n):
    """Write the m64nN accumulators of this thread to ``c[row0:row0+64, col0:col0+n]``.

    Accumulator layout (PTX ISA, wgmma D fragment): warp w of the warpgroup owns rows
    16w..16w+15; lane = 4g + q holds, for each 8-column block j, acc[4j + 2h + e] =
    C[16w + g + 8h, 8j + 2q + e] (h, e in {0, 1}).
    """
    tid = cuda.threadIdx.x % WARPGROUP
    r = row0 + (tid // 32) * 16 + (tid % 32) // 4
    cc = col0 + (tid % 4) * 2
    for j in range(n // 8):
        c[r, cc + 8 * j] = acc[4 * j]
        c[r, cc + 8 * j + 1] = acc[4 * j + 1]
        c[r + 8, cc + 8 * j] = acc[4 * j + 2]
        c[r + 8, cc + 8 * j + 1] = acc[4 * j + 3]


def make_wgmma_tma_gemm(bf16: bool):
    """Kernel ``(maps, c, k)``: maps = device uint64[2, 16] with the tensor maps of A (box
    64 x 64) and B (box 128 x 64), both 128B swizzle; c float32 (M, N); k = K (multiple of 64).
    Grid (N / 128, M / 64), 128 threads, ``GEMM_SHARED_BYTES`` of dynamic shared memory."""
    dtype = "bf16" if bf16 else "f16"
    mma = hp.wgmma_ss(GEMM_BN, dtype)
    fence_acc = hp.wgmma_fence_operand(GEMM_BN)

    def wgmma_tma_gemm(maps, c, k):
        smem = cuda.shared.array(0, types.uint16)
        bars = cuda.shared.array(GEMM_STAGES, types.uint64)
        tid = cuda.threadIdx.x
        base = _aligned_1024(ptx.shared_address_u16(smem))
        bar0 = ptx.shared_address_u64(bars)
        m0 = cuda.blockIdx.y * GEMM_BM
        n0 = cuda.blockIdx.x * GEMM_BN
        num_k = k // GEMM_BK

        if tid == 0:
            for s in range(GEMM_STAGES):
                hp.mbarrier_init(bar0 + 8 * s, 1)
            hp.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            hp.tma_prefetch_descriptor(maps[0])
            hp.tma_prefetch_descriptor(maps[1])
            for s in range(GEMM_STAGES):
                if s < num_k:
                    tile = base + s * _STAGE_BYTES
                    hp.mbarrier_arrive_expect_tx(bar0 + 8 * s, _STAGE_BYTES)
                    hp.tma_load_2d(tile, maps[0], bar0 + 8 * s, s * GEMM_BK, m0)
                    hp.tma_load_2d(tile + _A_TILE_BYTES, maps[1], bar0 + 8 * s, s * GEMM_BK, n0)

        acc = cuda.local.array(_GEMM_ACC, float32)
        for i in range(_GEMM_ACC):
            acc[i] = 0.0
        for kt in range(num_k):
            s = kt % GEMM_STAGES
            tile = base + s * _STAGE_BYTES
            hp.mbarrier_wait_parity(bar0 + 8 * s, (kt // GEMM_STAGES) % 2)
            desc_a = hp.smem_descriptor_k_sw128(tile)
            desc_b = hp.smem_descriptor_k_sw128(tile + _A_TILE_BYTES)
            fence_acc(acc)
            hp.wgmma_fence()
            for kk in range(_K_STEPS):  # 16 elements = 32 bytes along the swizzled row
                mma(acc, hp.descriptor_add(desc_a, 32 * kk), hp.descriptor_add(desc_b, 32 * kk), 1)
            hp.wgmma_commit_group()
            hp.wgmma_wait_group_0()
            fence_acc(acc)
            cuda.syncthreads()  # every warp is done with stage s before it is refilled
            nxt = kt + GEMM_STAGES
            if tid == 0 and nxt < num_k:
                hp.mbarrier_arrive_expect_tx(bar0 + 8 * s, _STAGE_BYTES)
                hp.tma_load_2d(tile, maps[0], bar0 + 8 * s, nxt * GEMM_BK, m0)
                hp.tma_load_2d(tile + _A_TILE_BYTES, maps[1], bar0 + 8 * s, nxt * GEMM_BK, n0)
        store_accumulators(c, acc, m0, n0, GEMM_BN)

    wgmma_tma_gemm.__name__ = f"wgmma_tma_gemm_{dtype}"
    return wgmma_tma_gemm


WGMMA_TMA_GEMM_ARGTYPES = (types.uint64[:, ::1], types.float32[:, ::1], types.int64)

# ---------------------------------------------------------------------------------------------
# Demo 2: C = A @ B, A from registers, B MN-major from shared memory (RS wgmma, trans-b)
# ---------------------------------------------------------------------------------------------

_B_CHUNK_BYTES = GEMM_BK * 128  # one TMA box: 64 k-rows x 64 n-columns, 128-byte rows
RS_SHARED_BYTES = GEMM_STAGES * GEMM_BN * GEMM_BK * 2 + 1024


@cuda.jit(device=True, forceinline=True)
def load_a_fragment(frag, a32, row0, k0):
    """This thread's wgmma/mma A fragment of rows ``row0 + 16*warp ..``, columns k0..k0+15
    from ``a32`` (the 16-bit matrix viewed as uint32 pairs): frag[0] = (g, 2q), frag[1] =
    (g + 8, 2q), frag[2] = (g, 2q + 8), frag[3] = (g + 8, 2q + 8), each two elements."""
    tid = cuda.threadIdx.x % WARPGROUP
    r = row0 + (tid // 32) * 16 + (tid % 32) // 4
    kc = k0 // 2 + tid % 4
    frag[0] = a32[r, kc]
    frag[1] = a32[r + 8, kc]
    frag[2] = a32[r, kc + 4]
    frag[3] = a32[r + 8, kc + 4]


def make_wgmma_rs_gemm(bf16: bool):
    """Kernel ``(a32, map_b, c, k)``: a32 = A (64·gridDim.y x K, 16-bit) viewed as uint32
    (M, K/2); map_b = device uint64[16] tensor map of B (K x N) with box 64 x 64, 128B
    swizzle; c float32 (M, N). Grid (N / 128, M / 64), 128 threads, ``RS_SHARED_BYTES``."""
    dtype = "bf16" if bf16 else "f16"
    mma = hp.wgmma_rs(GEMM_BN, dtype, trans_b=True)
    fence_acc = hp.wgmma_fence_operand(GEMM_BN)
    stage_bytes = GEMM_BN * GEMM_BK * 2

    def wgmma_rs_gemm(a32, map_b, c, k):
        smem = cuda.shared.array(0, types.uint16)
        bars = cuda.shared.array(GEMM_STAGES, types.uint64)
        tid = cuda.threadIdx.x
        base = _aligned_1024(ptx.shared_address_u16(smem))
        bar0 = ptx.shared_address_u64(bars)
        m0 = cuda.blockIdx.y * GEMM_BM
        n0 = cuda.blockIdx.x * GEMM_BN
        num_k = k // GEMM_BK

        if tid == 0:
            for s in range(GEMM_STAGES):
                hp.mbarrier_init(bar0 + 8 * s, 1)
            hp.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            for s in range(GEMM_STAGES):
                if s < num_k:
                    hp.mbarrier_arrive_expect_tx(bar0 + 8 * s, stage_bytes)
                    for j in range(GEMM_BN // 64):
                        dst = base + s * stage_bytes + j * _B_CHUNK_BYTES
                        hp.tma_load_2d(dst, map_b, bar0 + 8 * s, n0 + 64 * j, s * GEMM_BK)

        acc = cuda.local.array(_GEMM_ACC, float32)
        for i in range(_GEMM_ACC):
            acc[i] = 0.0
        frag = cuda.local.array((_K_STEPS, 4), uint32)
        for kt in range(num_k):
            s = kt % GEMM_STAGES
            for kk in range(_K_STEPS):
                load_a_fragment(frag[kk], a32, m0, kt * GEMM_BK + 16 * kk)
            hp.mbarrier_wait_parity(bar0 + 8 * s, (kt // GEMM_STAGES) % 2)
            desc_b = hp.smem_descriptor_mn_sw128(base + s * stage_bytes, _B_CHUNK_BYTES)
            fence_acc(acc)
            hp.wgmma_fence()
            for kk in range(_K_STEPS):  # 16 k-rows of 128 bytes = 2048 bytes
                mma(acc, frag[kk], hp.descriptor_add(desc_b, 2048 * kk), 1)
            hp.wgmma_commit_group()
            hp.wgmma_wait_group_0()
            fence_acc(acc)
            cuda.syncthreads()
            nxt = kt + GEMM_STAGES
            if tid == 0 and nxt < num_k:
                hp.mbarrier_arrive_expect_tx(bar0 + 8 * s, stage_bytes)
                for j in range(GEMM_BN // 64):
                    dst = base + s * stage_bytes + j * _B_CHUNK_BYTES
                    hp.tma_load_2d(dst, map_b, bar0 + 8 * s, n0 + 64 * j, nxt * GEMM_BK)
        store_accumulators(c, acc, m0, n0, GEMM_BN)

    wgmma_rs_gemm.__name__ = f"wgmma_rs_gemm_{dtype}"
    return wgmma_rs_gemm


WGMMA_RS_GEMM_ARGTYPES = (types.uint32[:, ::1], types.uint64[::1], types.float32[:, ::1], types.int64)

# ---------------------------------------------------------------------------------------------
# Demo 3: tiled 2-D copy, TMA load -> shared -> TMA store
# ---------------------------------------------------------------------------------------------

COPY_SHARED_WORDS = 8192  # 32 KB: the largest box the copy kernels take


def tma_copy_2d(maps, box_rows, box_cols):
    """Kernel ``(maps, box_rows, box_cols)``: maps[0] (source) and maps[1] (destination) are
    2-D maps with the same box; block (x, y) copies the box at rows y*box_rows, columns
    x*box_cols. One warp; thread 0 issues everything."""
    smem = cuda.shared.array(COPY_SHARED_WORDS, types.uint32, alignment=1024)
    bar = cuda.shared.array(1, types.uint64)
    if cuda.threadIdx.x == 0:
        tile = ptx.shared_address_u32(smem)
        b = ptx.shared_address_u64(bar)
        hp.mbarrier_init(b, 1)
        hp.fence_mbarrier_init()
        col = cuda.blockIdx.x * box_cols
        row = cuda.blockIdx.y * box_rows
        hp.mbarrier_arrive_expect_tx(b, box_rows * box_cols * 2)
        hp.tma_load_2d(tile, maps[0], b, col, row)
        hp.mbarrier_wait_parity(b, 0)
        hp.tma_store_2d(maps[1], tile, col, row)
        hp.tma_store_commit_group()
        hp.tma_store_wait_group_0()


TMA_COPY_2D_ARGTYPES = (types.uint64[:, ::1], types.int64, types.int64)


# ---------------------------------------------------------------------------------------------
# Host launchers for the demos
# ---------------------------------------------------------------------------------------------


@functools.cache
def _compiled(factory, bf16: bool, argtypes, shared_bytes: int):
    kernel = cuda.jit(argtypes)(factory(bf16))
    raise_dynamic_shared_limit(kernel, argtypes, shared_bytes)
    return kernel


def run_wgmma_tma_gemm(a_bits: np.ndarray, b_bits: np.ndarray, bf16: bool = False) -> np.ndarray:
    """C = A @ Bᵀ in float32 for 16-bit A (M x K) and B (N x K) given as uint16 bits;
    M, N, K multiples of 64, 128, 64."""
    from ..runtime.tensor_map import make_tensor_map, tensor_maps_to_device

    (m, k), (n, k2) = a_bits.shape, b_bits.shape
    if k != k2 or m % GEMM_BM or n % GEMM_BN or k % GEMM_BK:
        raise ValueError(f"shapes {a_bits.shape} x {b_bits.shape}: need M%64 = N%128 = K%64 = 0")
    dtype = "bf16" if bf16 else "f16"
    d_a = cuda.to_device(np.ascontiguousarray(a_bits, dtype=np.uint16))
    d_b = cuda.to_device(np.ascontiguousarray(b_bits, dtype=np.uint16))
    map_a = make_tensor_map(d_a, (GEMM_BM, GEMM_BK), swizzle="128B", dtype=dtype)
    map_b = make_tensor_map(d_b, (GEMM_BN, GEMM_BK), swizzle="128B", dtype=dtype)
    maps = tensor_maps_to_device(map_a, map_b)
    c = cuda.device_array((m, n), np.float32)
    kernel = _compiled(make_wgmma_tma_gemm, bf16, WGMMA_TMA_GEMM_ARGTYPES, GEMM_SHARED_BYTES)
    kernel[(n // GEMM_BN, m // GEMM_BM), WARPGROUP, 0, GEMM_SHARED_BYTES](maps, c, k)
    return c.copy_to_host()


def run_wgmma_rs_gemm(a_bits: np.ndarray, b_bits: np.ndarray, bf16: bool = False) -> np.ndarray:
    """C = A @ B in float32 for 16-bit A (M x K) and B (K x N) given as uint16 bits;
    M, N, K multiples of 64, 128, 64."""
    from ..runtime.tensor_map import make_tensor_map

    (m, k), (k2, n) = a_bits.shape, b_bits.shape
    if k != k2 or m % GEMM_BM or n % GEMM_BN or k % GEMM_BK:
        raise ValueError(f"shapes {a_bits.shape} x {b_bits.shape}: need M%64 = N%128 = K%64 = 0")
    dtype = "bf16" if bf16 else "f16"
    d_a32 = cuda.to_device(np.ascontiguousarray(a_bits, dtype=np.uint16).view(np.uint32))
    d_b = cuda.to_device(np.ascontiguousarray(b_bits, dtype=np.uint16))
    map_b = make_tensor_map(d_b, (GEMM_BK, 64), swizzle="128B", dtype=dtype)
    d_map_b = map_b.to_device()
    c = cuda.device_array((m, n), np.float32)
    kernel = _compiled(make_wgmma_rs_gemm, bf16, WGMMA_RS_GEMM_ARGTYPES, RS_SHARED_BYTES)
    kernel[(n // GEMM_BN, m // GEMM_BM), WARPGROUP, 0, RS_SHARED_BYTES](d_a32, d_map_b, c, k)
    return c.copy_to_host()


def registered() -> dict:
    """name -> (python kernel function, argument types, architectures) for offline inspection."""
    hopper = ("sm_90a",)
    return {
        "wgmma_tma_gemm_f16": (make_wgmma_tma_gemm(False), WGMMA_TMA_GEMM_ARGTYPES, hopper),
        "wgmma_tma_gemm_bf16": (make_wgmma_tma_gemm(True), WGMMA_TMA_GEMM_ARGTYPES, hopper),
        "wgmma_rs_gemm_f16": (make_wgmma_rs_gemm(False), WGMMA_RS_GEMM_ARGTYPES, hopper),
        "wgmma_rs_gemm_bf16": (make_wgmma_rs_gemm(True), WGMMA_RS_GEMM_ARGTYPES, hopper),
        "tma_copy_2d": (tma_copy_2d, TMA_COPY_2D_ARGTYPES, hopper),
    }
