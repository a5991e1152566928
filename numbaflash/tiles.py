"""Tile helpers for the mma.sync kernels: swizzled shared-memory tiles, cp.async tile
copies, ldmatrix fragment loads and the online-softmax steps.

A shared tile holds ``rows x head_dim`` 16-bit elements, row-major, in 16-byte chunks.
Chunk ``c`` of row ``r`` is stored at chunk position ``c ^ (r % 8)`` of that row (XOR on
the low three bits, CuTe's Swizzle<3,4,3>): the 8 rows one ldmatrix reads, and the
chunks one warp's cp.async writes, fall in 8 different 16-byte bank groups, so
neither the loads nor the stores conflict. Needs rows of at least 8 chunks (head_dim >= 64).

Register fragments follow the PTX ISA layout of mma.m16n8k16: lane ``l`` holds rows
``l // 4`` and ``l // 4 + 8`` and columns ``2 * (l % 4)`` and ``+1`` of each 8-wide n-tile.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from . import ptx

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)


@cuda.jit(device=True, inline="always")
def swizzled_offset(row, chunk, chunks_per_row):
    """Byte offset of 16-byte ``chunk`` of ``row`` in a swizzled tile."""
    return (row * chunks_per_row + (chunk ^ (row % 8))) * 16


@cuda.jit(device=True, inline="always")
def copy_tile_async(smem_tile, src, src_base, row_stride, first_row, num_rows, tile_rows,
                    chunks_per_row, tid, num_threads):
    """Issue cp.async copies of ``tile_rows`` rows (``first_row`` ...) of a global matrix
    into a swizzled shared tile. Row ``i`` starts at ``src[src_base + i * row_stride]``;
    rows at or past ``num_rows`` are zero-filled and never read.

    Thread ``tid`` copies chunk ``tid % chunks_per_row`` of rows ``tid // chunks_per_row``
    + multiples of ``num_threads // chunks_per_row`` (a multiple of 8, so the swizzle
    pattern, and hence the shared offset step, is the same for each of its rows)."""
    rows_per_pass = num_threads // chunks_per_row
    row = tid // chunks_per_row
    chunk = tid % chunks_per_row
    dst = smem_tile + swizzled_offset(row, chunk, chunks_per_row)
    src_index = src_base + (first_row + row) * row_stride + chunk * 8
    if first_row + tile_rows <= num_rows:  # the whole tile is in range: no checks
        for i in range(tile_rows // rows_per_pass):
            ptx.cp_async_16(dst + i * rows_per_pass * chunks_per_row * 16, src,
                            src_index + i * rows_per_pass * row_stride)
    else:
        for i in range(tile_rows // rows_per_pass):
            ptx.cp_async_16_zfill(
                dst + i * rows_per_pass * chunks_per_row * 16,
                src,
                src_index + i * rows_per_pass * row_stride,
                first_row + row + i * rows_per_pass < num_rows,
            )


@cuda.jit(device=True, inline="always")
def ldmatrix_offsets(offsets, row, half, chunks_per_row):
    """This lane's byte offsets for ldmatrix reads of 16-column blocks of a swizzled tile.

    The lane addresses ``row`` (any row congruent to it mod 8 reuses the pattern) and the
    8-column ``half`` (0 or 1) of 16-column block ``kb``. Column chunk ``2*kb + half``
    XOR ``row % 8`` only changes the low three bits, so the offset of block ``kb`` is
    ``offsets[kb % 4] + 128 * (kb // 4)``: four registers per lane, the rest immediates."""
    for b in range(4):
        offsets[b] = (row * chunks_per_row + ((2 * b + half) ^ (row % 8))) * 16


@cuda.jit(device=True, inline="always")
def block_offset(offsets, kb):
    """Offset of 16-column block ``kb`` (compile-time constant) from ``ldmatrix_offsets``."""
    return offsets[kb % 4] + 128 * (kb // 4)


@cuda.jit(device=True, inline="always")
def load_a_fragments(frags, smem_tile, row0, k_tiles, chunks_per_row, lane):
    """ldmatrix the A operand (16 rows from ``row0``, ``k_tiles`` x 16 columns) of a
    row-major tile: ``frags[kt, 0:4]`` is the m16k16 A fragment of k-tile ``kt``."""
    row = row0 + lane % 16
    for kt in range(k_tiles):
        ptx.ldmatrix_x4(frags[kt], smem_tile + swizzled_offset(row, kt * 2 + lane // 16, chunks_per_row))


@cuda.jit(device=True, inline="always")
def quad_max(x):
    """Max over the 4 lanes that share a fragment row."""
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
    return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))


@cuda.jit(device=True, inline="always")
def quad_sum(x):
    """Sum over the 4 lanes that share a fragment row."""
    x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
    return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)


@cuda.jit(device=True, inline="always")
def row_max(s, n_tiles, half):
    """Max of this lane's scores in fragment row ``half`` (0: row g, 1: row g+8), reduced
    over the quad."""
    m = NEG_INF
    for j in range(n_tiles):
        m = max(m, max(s[j, 2 * half], s[j, 2 * half + 1]))
    return quad_max(m)
