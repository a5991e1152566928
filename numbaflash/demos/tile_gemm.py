"""A tensor-core tile GEMM, C = A @ Bᵀ (fp16 or bf16 in, float32 out): the demo kernel.

One CTA of 4 warps computes a 64x64 tile of C; each warp owns 16 rows. K is streamed in
32-wide slices through shared memory with cp.async (double buffered), read with ldmatrix
and multiplied with mma.sync m16n8k16. Shapes: M, N, K multiples of 64, 64, 32.
"""

from __future__ import annotations

from numba import cuda, float32, types, uint32

from .. import ptx

TILE_M = 64
TILE_N = 64
TILE_K = 32
THREADS = 128
N_TILES = TILE_N // 8  # mma n-tiles per warp


def make_tile_gemm(bf16: bool):
    """Return the GEMM kernel for fp16 (``bf16=False``) or bf16 inputs.

    Arguments: a (M*K,) uint16 bits of A row-major, b (N*K,) uint16 bits of B row-major,
    c (M, N) float32, and the sizes m, n, k.
    """
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    def tile_gemm(a, b, c, m, n, k):
        # Two stages of A and B slices: [stage][row][TILE_K] 16-bit elements, unswizzled
        # rows of 64 bytes (this demo favours clarity over bank-conflict freedom).
        sa = cuda.shared.array((2, TILE_M, TILE_K), types.uint16, alignment=16)
        sb = cuda.shared.array((2, TILE_N, TILE_K), types.uint16, alignment=16)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        row0 = cuda.blockIdx.y * TILE_M
        col0 = cuda.blockIdx.x * TILE_N
        sa_base = ptx.shared_address_u16(sa)
        sb_base = ptx.shared_address_u16(sb)

        acc = cuda.local.array((N_TILES, 4), float32)
        for j in range(N_TILES):
            for e in range(4):
                acc[j, e] = 0.0
        afrag = cuda.local.array(4, uint32)
        bfrag = cuda.local.array(4, uint32)

        num_slices = k // TILE_K
        # Each thread copies 2 chunks of 16 bytes of A and of B per slice (64 rows x 4 chunks).
        for s in range(min(2, num_slices)):
            for i in range(2):
                chunk = tid + i * THREADS
                r = chunk // 4
                ck = (chunk % 4) * 8
                off = ((s * TILE_M + r) * TILE_K + ck) * 2
                ptx.cp_async_16(sa_base + off, a, (row0 + r) * k + s * TILE_K + ck)
                ptx.cp_async_16(sb_base + off, b, (col0 + r) * k + s * TILE_K + ck)
            ptx.cp_async_commit_group()

        for s in range(num_slices):
            stage = s % 2
            if s + 1 < num_slices:
                ptx.cp_async_wait_group_1()
            else:
                ptx.cp_async_wait_group_0()
            cuda.syncthreads()
            for kk in range(TILE_K // 16):
                # A fragment: rows warp*16 + lane%16, columns kk*16 + (lane//16)*8.
                ar = warp * 16 + lane % 16
                ac = kk * 16 + (lane // 16) * 8
                ptx.ldmatrix_x4(afrag, sa_base + ((stage * TILE_M + ar) * TILE_K + ac) * 2)
                for j in range(N_TILES // 2):
                    # Two n-tiles of B: rows j*16 + (lane&7) + (lane>>4)*8, k half (lane>>3)&1.
                    br = j * 16 + (lane % 8) + (lane // 16) * 8
                    bc = kk * 16 + ((lane // 8) % 2) * 8
                    ptx.ldmatrix_x4(bfrag, sb_base + ((stage * TILE_N + br) * TILE_K + bc) * 2)
                    mma(acc[2 * j], afrag, bfrag[0:2])
                    mma(acc[2 * j + 1], afrag, bfrag[2:4])
            cuda.syncthreads()  # everyone is done with this stage before it is refilled
            if s + 2 < num_slices:
                for i in range(2):
                    chunk = tid + i * THREADS
                    r = chunk // 4
                    ck = (chunk % 4) * 8
                    off = ((stage * TILE_M + r) * TILE_K + ck) * 2
                    ptx.cp_async_16(sa_base + off, a, (row0 + r) * k + (s + 2) * TILE_K + ck)
                    ptx.cp_async_16(sb_base + off, b, (col0 + r) * k + (s + 2) * TILE_K + ck)
                ptx.cp_async_commit_group()

        g = lane // 4
        t = lane % 4
        for j in range(N_TILES):
            r = row0 + warp * 16 + g
            cc = col0 + j * 8 + t * 2
            c[r, cc] = acc[j, 0]
            c[r, cc + 1] = acc[j, 1]
            c[r + 8, cc] = acc[j, 2]
            c[r + 8, cc + 1] = acc[j, 3]

    tile_gemm.__name__ = "tile_gemm_bf16" if bf16 else "tile_gemm_f16"
    return tile_gemm


TILE_GEMM_ARGTYPES = (
    types.uint16[::1],
    types.uint16[::1],
    types.float32[:, ::1],
    types.int64,
    types.int64,
    types.int64,
)
