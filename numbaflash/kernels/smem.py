"""Swizzled shared-memory tiles and the copies that fill them.

A shared tile holds ``rows x head_dim`` 16-bit elements as column blocks of 64 elements:
block ``b`` is ``rows`` rows of 128 bytes, and 16-byte chunk ``c`` of row ``r`` sits at
chunk position ``c ^ (r % 8)`` of its row (CuTe's Swizzle<3,4,3>). This is the 128-byte
swizzle layout that wgmma descriptors and TMA use (tiles 1024-byte aligned), and it makes
ldmatrix and cp.async conflict free: the 8 rows one ldmatrix reads, and the chunks one
warp writes, fall in 8 different 16-byte bank groups. Needs head_dim a multiple of 64.

Register fragments follow the PTX ISA layout of mma.m16n8k16: lane ``l`` holds rows
``l // 4`` and ``l // 4 + 8`` and columns ``2 * (l % 4)`` and ``+1`` of each 8-wide n-tile.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda

from .. import ptx

# Rows of a matrix in a flat global array: row i starts at ``array[base + i * row_stride]``;
# rows at or past ``num_rows`` lie outside it (loads zero-fill them, stores skip them).
GlobalRows = namedtuple("GlobalRows", ["array", "base", "row_stride", "num_rows"])


@cuda.jit(device=True, inline="always")
def swizzled_offset(row, chunk, tile_rows):
    """Byte offset of 16-byte ``chunk`` of ``row`` in a swizzled tile of ``tile_rows`` rows."""
    return (chunk // 8) * (tile_rows * 128) + row * 128 + ((chunk % 8) ^ (row % 8)) * 16


@cuda.jit(device=True, inline="always")
def copy_tile_async(smem_tile, tile_rows, src, first_row, chunks_per_row, tid, num_threads):
    """Issue cp.async copies of rows ``first_row`` .. ``+ tile_rows`` of ``src`` (GlobalRows)
    into a swizzled shared tile; rows past ``src.num_rows`` are zero-filled and never read.

    Thread ``tid`` copies chunk ``tid % chunks_per_row`` of rows ``tid // chunks_per_row``
    + multiples of ``num_threads // chunks_per_row`` (a multiple of 8, so the swizzle
    pattern, and hence the shared offset step, is the same for each of its rows); when that
    step does not divide ``tile_rows``, the last pass copies only the rows that remain."""
    rows_per_pass = num_threads // chunks_per_row
    passes = (tile_rows + rows_per_pass - 1) // rows_per_pass
    row = tid // chunks_per_row
    chunk = tid % chunks_per_row
    dst = smem_tile + swizzled_offset(row, chunk, tile_rows)
    src_index = src.base + (first_row + row) * src.row_stride + chunk * 8
    full = first_row + tile_rows <= src.num_rows  # the whole tile is in range: no row checks
    for i in range(passes):
        r = row + i * rows_per_pass
        to = dst + i * rows_per_pass * 128
        at = src_index + i * rows_per_pass * src.row_stride
        if tile_rows % rows_per_pass == 0 or r < tile_rows:
            if full:
                ptx.cp_async_16(to, src.array, at)
            else:
                ptx.cp_async_16_zfill(to, src.array, at, first_row + r < src.num_rows)


@cuda.jit(device=True, inline="always")
def drain_copies():
    """Wait for this thread's cp.async copies, then for every thread: after this, shared
    memory may be rewritten with ordinary stores. A CTA whose rows see no key runs no KV
    iteration, so without this its Q copy can still land on the staged output."""
    ptx.cp_async_wait_group_0()
    cuda.syncthreads()


@cuda.jit(device=True, inline="always")
def ldmatrix_offsets(offsets, row, half):
    """This lane's byte offsets for ldmatrix reads of 16-column blocks of a swizzled tile.

    The lane addresses ``row`` (any row congruent to it mod 8 reuses the pattern, at
    ``+128`` bytes per row) and the 8-column ``half`` (0 or 1) of 16-column block ``kb``:
    chunk ``2*kb + half``. Its offset is ``offsets[kb % 4]`` plus the start of 64-column
    block ``kb // 4``: four registers per lane, the rest immediates."""
    for b in range(4):
        offsets[b] = row * 128 + ((2 * b + half) ^ (row % 8)) * 16


@cuda.jit(device=True, inline="always")
def block_offset(offsets, kb, tile_rows):
    """Offset of 16-column block ``kb`` (compile-time constant) from ``ldmatrix_offsets``."""
    return offsets[kb % 4] + (kb // 4) * (tile_rows * 128)


@cuda.jit(device=True, inline="always")
def load_a_fragments(frags, smem_tile, row0, k_tiles, tile_rows, lane):
    """ldmatrix the A operand (16 rows from ``row0``, ``k_tiles`` x 16 columns) of a
    row-major tile: ``frags[kt, 0:4]`` is the m16k16 A fragment of k-tile ``kt``."""
    row = row0 + lane % 16
    for kt in range(k_tiles):
        ptx.ldmatrix_x4(frags[kt], smem_tile + swizzled_offset(row, kt * 2 + lane // 16, tile_rows))
