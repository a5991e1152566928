"""Tiny test kernels, one per sm_80 helper family, shared by the GPU tests
(``test_ptx_sm80_gpu.py``) and the offline SASS tests (``test_inspect_sm80_offline.py``).

Every kernel is a plain Python function (jit it with ``cuda.jit``) with example argument
types for offline compilation in ``KERNELS``. Launch shapes are given in the docstrings.
"""

from __future__ import annotations

from numba import cuda, float32, types, uint16, uint32

from numbaflash import ptx
from numbaflash.demos.tile_gemm import TILE_GEMM_ARGTYPES, make_tile_gemm
from numbaflash.kernels.common import unroll

LANES = 32
POOL_ROWS = 64  # 16-byte rows of 8 uint16 in the ldmatrix source pool
POOL_ELEMS = POOL_ROWS * 8
ROW_ELEMS = LANES * 8  # one 16-byte row per lane
POISON16 = 0xDEAD
POISON32 = 0xDEADBEEF

# cp.async wait_group test: GROUPS commit groups, each of CHUNKS 16-byte chunks per thread.
WAIT_THREADS = 128
GROUPS = 4
CHUNKS = 2
GROUP_ELEMS = WAIT_THREADS * CHUNKS * 8  # uint16 elements per group
WAIT_ELEMS = GROUPS * GROUP_ELEMS
VEC4_WORDS = LANES * 4


def make_ldmatrix_kernel(load, nregs):
    """Launch [1, 32]. ``pool`` (POOL_ROWS*8,) uint16 is staged in shared memory; lane l
    passes the address of pool row ``row_of_lane[l]``; ``out[l, i]`` = register i of lane l."""

    def ldmatrix_kernel(pool, row_of_lane, out):
        smem = cuda.shared.array(POOL_ELEMS, uint16, alignment=16)
        lane = cuda.threadIdx.x
        for i in range(lane, POOL_ELEMS, LANES):
            smem[i] = pool[i]
        cuda.syncthreads()
        regs = cuda.local.array(nregs, uint32)
        load(regs, ptx.shared_address_u16(smem) + row_of_lane[lane] * 16)
        for i in range(nregs):
            out[lane, i] = regs[i]

    return ldmatrix_kernel


LDMATRIX_ARGTYPES = (types.uint16[::1], types.int32[::1], types.uint32[:, ::1])


def make_mma_kernel(mma):
    """Launch [1, 32]. Lane l's fragments: ``a[l]`` (4 x f16x2 bits), ``b[l]`` (2), ``c[l]``
    (4 f32 accumulators); ``d[l]`` receives the accumulators after one mma."""

    def mma_kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        fa = cuda.local.array(4, uint32)
        fb = cuda.local.array(2, uint32)
        acc = cuda.local.array(4, float32)
        for i in range(4):
            fa[i] = a[lane, i]
            acc[i] = c[lane, i]
        for i in range(2):
            fb[i] = b[lane, i]
        mma(acc, fa, fb)
        for i in range(4):
            d[lane, i] = acc[i]

    return mma_kernel


MMA_ARGTYPES = (types.uint32[:, ::1], types.uint32[:, ::1], types.float32[:, ::1], types.float32[:, ::1])


def make_cp_async_kernel(by_address):
    """Launch [1, 32]. ``src`` holds ``nrows`` rows of 8 uint16. Lane l copies src row
    ``plain_rows[l]`` with cp.async into shared row l of one buffer, and src row
    ``zfill_rows[l]`` (in range iff < nrows) with the zero-fill form into another; both
    buffers are poisoned first and copied out after wait_group 0. ``by_address``: the
    ``*_at`` forms, from global byte addresses (out-of-range rows name row 0)."""

    def cp_async_kernel(src, plain_rows, zfill_rows, nrows, out_plain, out_zfill):
        plain = cuda.shared.array(ROW_ELEMS, uint16, alignment=16)
        zfill = cuda.shared.array(ROW_ELEMS, uint16, alignment=16)
        lane = cuda.threadIdx.x
        for i in range(8):
            plain[lane * 8 + i] = POISON16
            zfill[lane * 8 + i] = POISON16
        cuda.syncthreads()
        row = zfill_rows[lane]
        if by_address:
            origin = ptx.global_address(src)
            ptx.cp_async_16_at(ptx.shared_address_u16(plain) + lane * 16, origin + plain_rows[lane] * 16)
            at = origin + row * 16 if row < nrows else origin
            ptx.cp_async_16_zfill_at(ptx.shared_address_u16(zfill) + lane * 16, at, row < nrows)
        else:
            ptx.cp_async_16(ptx.shared_address_u16(plain) + lane * 16, src, plain_rows[lane] * 8)
            ptx.cp_async_16_zfill(ptx.shared_address_u16(zfill) + lane * 16, src, row * 8, row < nrows)
        ptx.cp_async_commit_group()
        ptx.cp_async_wait_group_0()
        cuda.syncthreads()
        for i in range(lane, ROW_ELEMS, LANES):
            out_plain[i] = plain[i]
            out_zfill[i] = zfill[i]

    return cp_async_kernel


CP_ASYNC_ARGTYPES = (
    types.uint16[::1], types.int32[::1], types.int32[::1], types.int32,
    types.uint16[::1], types.uint16[::1],
)

_WAITS = (
    ptx.cp_async_wait_group_0,
    ptx.cp_async_wait_group_1,
    ptx.cp_async_wait_group_2,
    ptx.cp_async_wait_group_3,
)


def make_wait_group_kernel(n):
    """Launch [1, WAIT_THREADS]. Issue GROUPS commit groups of cp.async (group g copies
    ``src[g*GROUP_ELEMS:(g+1)*GROUP_ELEMS]`` into poisoned shared memory), then
    ``cp.async.wait_group n`` and copy out only the GROUPS-n oldest groups, which must have
    landed. ``out`` beyond them is left untouched."""
    wait = _WAITS[n]
    landed = (GROUPS - n) * GROUP_ELEMS

    def wait_group_kernel(src, out):
        smem = cuda.shared.array(WAIT_ELEMS, uint16, alignment=16)
        tid = cuda.threadIdx.x
        for i in range(tid, WAIT_ELEMS, WAIT_THREADS):
            smem[i] = POISON16
        cuda.syncthreads()
        base = ptx.shared_address_u16(smem)
        for g in range(GROUPS):
            for c in range(CHUNKS):
                chunk = (g * CHUNKS + c) * WAIT_THREADS + tid
                ptx.cp_async_16(base + chunk * 16, src, chunk * 8)
            ptx.cp_async_commit_group()
        wait()
        cuda.syncthreads()
        for i in range(tid, landed, WAIT_THREADS):
            out[i] = smem[i]
        ptx.cp_async_wait_group_0()  # leave no copy in flight at exit

    wait_group_kernel.__name__ = f"wait_group_{n}_kernel"
    return wait_group_kernel


WAIT_GROUP_ARGTYPES = (types.uint16[::1], types.uint16[::1])


def make_vec4_kernel(by_address):
    """Launch [1, 32]. Lane l stores ``src[l]`` (4 uint32) with st.shared.v4 into shared
    row ``store_row[l]`` (16 bytes each, poisoned first); the shared buffer is copied out
    with plain loads into ``out_shared``; then lane l loads shared row ``load_row[l]`` with
    ld.shared.v4 and writes it with st.global.v4 to ``out_global[8*l : 8*l+8]`` (uint16;
    ``by_address``: with ``st_global_v4_at``)."""

    def vec4_kernel(src, store_row, load_row, out_shared, out_global):
        smem = cuda.shared.array(VEC4_WORDS, uint32, alignment=16)
        lane = cuda.threadIdx.x
        for i in range(4):
            smem[lane * 4 + i] = POISON32
        cuda.syncthreads()
        base = ptx.shared_address_u32(smem)
        regs = cuda.local.array(4, uint32)
        for i in range(4):
            regs[i] = src[lane, i]
        ptx.st_shared_v4(base + store_row[lane] * 16, regs)
        cuda.syncthreads()
        for i in range(4):
            out_shared[lane * 4 + i] = smem[lane * 4 + i]
        back = cuda.local.array(4, uint32)
        ptx.ld_shared_v4(back, base + load_row[lane] * 16)
        if by_address:
            ptx.st_global_v4_at(ptx.global_address(out_global) + lane * 16, back)
        else:
            ptx.st_global_v4(out_global, lane * 8, back)

    return vec4_kernel


VEC4_ARGTYPES = (
    types.uint32[:, ::1], types.int32[::1], types.int32[::1], types.uint32[::1], types.uint16[::1],
)


def ld_global_nc_kernel(src, load_chunk, out):
    """Launch [1, 32]. Lane l loads 16-byte chunk ``load_chunk[l]`` of ``src`` (uint16) with
    ``ld_global_nc_v4_at`` and stores it with ``st_global_v4_at`` at chunk l of ``out``."""
    lane = cuda.threadIdx.x
    regs = cuda.local.array(4, uint32)
    ptx.ld_global_nc_v4_at(regs, ptx.global_address(src) + load_chunk[lane] * 16)
    ptx.st_global_v4_at(ptx.global_address(out) + lane * 16, regs)


LD_GLOBAL_NC_ARGTYPES = (types.uint16[::1], types.int32[::1], types.uint16[::1])


def shared_address_kernel(values, out16, out32, outf, out64, addresses, loaded):
    """Launch [1, 32]. One 128-byte shared array of each dtype (u16, u32, f32, u64), poisoned;
    lane l writes ``values[k, l]`` with st.shared.b32 at byte 4*l of array k (address from the
    matching ``shared_address_*``); arrays are read back with plain loads. Lane 0 records the
    four base addresses and the address of ``a16[8:]`` in ``addresses``; lane l also reads
    float (7 l) % 32 of the f32 array back with ld_shared_f32 into ``loaded``."""
    a16 = cuda.shared.array(64, uint16, alignment=16)
    a32 = cuda.shared.array(32, uint32, alignment=16)
    af = cuda.shared.array(32, float32, alignment=16)
    a64 = cuda.shared.array(16, types.uint64, alignment=16)
    lane = cuda.threadIdx.x
    a16[2 * lane] = POISON16
    a16[2 * lane + 1] = POISON16
    a32[lane] = POISON32
    af[lane] = -1.0
    if lane < 16:
        a64[lane] = POISON32
    cuda.syncthreads()
    b16 = ptx.shared_address_u16(a16)
    b32 = ptx.shared_address_u32(a32)
    bf = ptx.shared_address_f32(af)
    b64 = ptx.shared_address_u64(a64)
    ptx.st_shared_b32(b16 + lane * 4, values[0, lane])
    ptx.st_shared_b32(b32 + lane * 4, values[1, lane])
    ptx.st_shared_b32(bf + lane * 4, values[2, lane])
    ptx.st_shared_b32(b64 + lane * 4, values[3, lane])
    cuda.syncthreads()
    loaded[lane] = ptx.ld_shared_f32(bf + ((7 * lane) % 32) * 4)
    out16[2 * lane] = a16[2 * lane]
    out16[2 * lane + 1] = a16[2 * lane + 1]
    out32[lane] = a32[lane]
    outf[lane] = af[lane]
    if lane < 16:
        out64[lane] = a64[lane]
    if lane == 0:
        addresses[0] = b16
        addresses[1] = b32
        addresses[2] = bf
        addresses[3] = b64
        addresses[4] = ptx.shared_address_u16(a16[8:])


SHARED_ADDRESS_ARGTYPES = (
    types.uint32[:, ::1], types.uint16[::1], types.uint32[::1], types.float32[::1],
    types.uint64[::1], types.uint32[::1], types.float32[::1],
)


def pack_kernel(lo, hi, out_f16, out_bf16):
    """Launch over lo.size threads: out_*[i] = cvt.rn.{f16,bf16}x2.f32 of (lo[i], hi[i])."""
    i = cuda.grid(1)
    if i < lo.size:
        out_f16[i] = ptx.pack_f16x2(lo[i], hi[i])
        out_bf16[i] = ptx.pack_bf16x2(lo[i], hi[i])


PACK_ARGTYPES = (types.float32[::1], types.float32[::1], types.uint32[::1], types.uint32[::1])


def exp2_kernel(x, out):
    """Launch over x.size threads: out[i] = ex2.approx.ftz.f32(x[i])."""
    i = cuda.grid(1)
    if i < x.size:
        out[i] = ptx.exp2(x[i])


EXP2_ARGTYPES = (types.float32[::1], types.float32[::1])


def tanh_kernel(x, out):
    """Launch over x.size threads: out[i] = tanh.approx.f32(x[i])."""
    i = cuda.grid(1)
    if i < x.size:
        out[i] = ptx.tanh(x[i])


def exp2_poly_kernel(x, out):
    """Launch over x.size threads: out[i] = ex2_poly3_f32(x[i]) (no MUFU)."""
    i = cuda.grid(1)
    if i < x.size:
        out[i] = ptx.exp2_poly(x[i])


def red_add_kernel(values, index, out):
    """Launch over values.size threads: out[index[i]] += values[i] by red.global.add.f32, so each
    out element receives the sum of its values (in some order)."""
    i = cuda.grid(1)
    if i < values.size:
        ptx.red_global_add_f32(ptx.global_address_f32(out) + index[i] * 4, values[i])


RED_ADD_ARGTYPES = (types.float32[::1], types.int64[::1], types.float32[::1])


def turns_kernel(counter, order):
    """Launch [blocks, 32]: block b waits until counter[0] == b (acquire), appends b to
    ``order`` at position counter[0] with a plain store, then releases counter[0] + 1: the
    blocks pass in index order, each seeing the stores of those before."""
    b = cuda.blockIdx.x
    at = ptx.global_address_i32(counter)
    if cuda.threadIdx.x == 0:
        while ptx.ld_acquire_gpu_s32(at) != b:
            pass
        turn = ptx.ld_acquire_gpu_s32(at)
        order[turn] = b
        ptx.red_release_gpu_add_s32(at, 1)


TURNS_ARGTYPES = (types.int32[::1], types.int32[::1])


def bits_to_f32_kernel(bits, out_f16, out_bf16):
    """Launch over bits.size threads: the 16-bit pattern bits[i] read as f16 and as bf16."""
    i = cuda.grid(1)
    if i < bits.size:
        out_f16[i] = ptx.f32_from_f16_bits(uint32(bits[i]))
        out_bf16[i] = ptx.f32_from_bf16_bits(uint32(bits[i]))


BITS_TO_F32_ARGTYPES = (types.uint16[::1], types.float32[::1], types.float32[::1])

UNROLL_STEPS = 12


@cuda.jit(device=True, forceinline=True)
def _running_sum_step(k, state):
    """Step k of ``unroll_kernel``: acc[k] = acc[k - 1] + 2^(x + k), so order matters."""
    acc, x = state
    previous = acc[k - 1] if k > 0 else float32(0.0)
    acc[k] = previous + ptx.exp2(x + float32(k))


_running_sums = unroll(_running_sum_step, UNROLL_STEPS)


def unroll_kernel(x, out):
    """One thread: out[k] = sum over i <= k of 2^(x[0] + i), k < UNROLL_STEPS, through
    ``common.unroll`` (a local array indexed by the step number stays in registers)."""
    acc = cuda.local.array(UNROLL_STEPS, float32)
    _running_sums((acc, x[0]))
    for k in range(UNROLL_STEPS):
        out[k] = acc[k]


_LDMATRIX = {
    "ldmatrix_x1": (ptx.ldmatrix_x1, 1),
    "ldmatrix_x2": (ptx.ldmatrix_x2, 2),
    "ldmatrix_x4": (ptx.ldmatrix_x4, 4),
    "ldmatrix_x1_trans": (ptx.ldmatrix_x1_trans, 1),
    "ldmatrix_x2_trans": (ptx.ldmatrix_x2_trans, 2),
    "ldmatrix_x4_trans": (ptx.ldmatrix_x4_trans, 4),
}


def _named(fn, name):
    fn.__name__ = name
    return fn


# name -> (python kernel function, example argument types)
KERNELS = {
    **{
        name: (_named(make_ldmatrix_kernel(fn, n), f"{name}_kernel"), LDMATRIX_ARGTYPES)
        for name, (fn, n) in _LDMATRIX.items()
    },
    "mma_f16": (_named(make_mma_kernel(ptx.mma_m16n8k16_f16), "mma_f16_kernel"), MMA_ARGTYPES),
    "mma_bf16": (_named(make_mma_kernel(ptx.mma_m16n8k16_bf16), "mma_bf16_kernel"), MMA_ARGTYPES),
    "cp_async": (_named(make_cp_async_kernel(False), "cp_async_kernel"), CP_ASYNC_ARGTYPES),
    "cp_async_at": (_named(make_cp_async_kernel(True), "cp_async_at_kernel"), CP_ASYNC_ARGTYPES),
    **{f"wait_group_{n}": (make_wait_group_kernel(n), WAIT_GROUP_ARGTYPES) for n in range(4)},
    "vec4": (_named(make_vec4_kernel(False), "vec4_kernel"), VEC4_ARGTYPES),
    "vec4_at": (_named(make_vec4_kernel(True), "vec4_at_kernel"), VEC4_ARGTYPES),
    "ld_global_nc": (ld_global_nc_kernel, LD_GLOBAL_NC_ARGTYPES),
    "shared_address": (shared_address_kernel, SHARED_ADDRESS_ARGTYPES),
    "pack": (pack_kernel, PACK_ARGTYPES),
    "exp2": (exp2_kernel, EXP2_ARGTYPES),
    "exp2_poly": (exp2_poly_kernel, EXP2_ARGTYPES),
    "tanh": (tanh_kernel, EXP2_ARGTYPES),
    "unroll": (unroll_kernel, EXP2_ARGTYPES),
    "red_add": (red_add_kernel, RED_ADD_ARGTYPES),
    "turns": (turns_kernel, TURNS_ARGTYPES),
    "bits_to_f32": (bits_to_f32_kernel, BITS_TO_F32_ARGTYPES),
    "tile_gemm_f16": (make_tile_gemm(False), TILE_GEMM_ARGTYPES),
    "tile_gemm_bf16": (make_tile_gemm(True), TILE_GEMM_ARGTYPES),
}

__all__ = ["KERNELS"]
