"""Swizzled shared-memory tiles and the copies that fill them.

A shared tile holds ``rows x head_dim`` 16-bit elements as column blocks of 64 elements:
block ``b`` is ``rows`` rows of 128 bytes, and 16-byte chunk ``c`` of row ``r`` sits at
chunk position ``c ^ (r % 8)`` of its row (CuTe's Swizzle<3,4,3>). This is the 128-byte
swizzle layout that wgmma descriptors and TMA use (tiles 1024-byte aligned), and it makes
ldmatrix and cp.async conflict free: the 8 rows one ldmatrix reads, and the chunks one
warp writes, fall in 8 different 16-byte bank groups. Needs head_dim a multiple of 64.

Head dims that are an odd multiple of 32 (32, 96) use column blocks of 32 elements instead
(``row_bytes`` 64, every helper below takes it; 128 is the default): chunk ``c`` (0..3) of
row ``r`` sits at ``c ^ ((r // 2) % 4)`` (Swizzle<2,4,3>). Eight consecutive rows from a
multiple of 8 (one ldmatrix matrix, or one epilogue store) then fall in 8 different bank
groups: row ``r``'s chunk lands in group ``4 * (r % 2) + (c ^ (r // 2 % 4))``, and over rows
0..7 that takes every value 0..7 once. Both swizzles repeat every 8 rows.

Register fragments follow the PTX ISA layout of mma.m16n8k16: lane ``l`` holds rows
``l // 4`` and ``l // 4 + 8`` and columns ``2 * (l % 4)`` and ``+1`` of each 8-wide n-tile.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, uint32

from .. import ptx

# Rows of a matrix in global memory by byte address: row i starts at ``address + i * stride``;
# rows at or past ``num_rows`` lie outside it (loads zero-fill them, stores skip them). Row 0
# always exists (seqlen >= 1): zero-filled copies name it as their harmless source.
GlobalRows = namedtuple("GlobalRows", ["address", "stride", "num_rows"])


@cuda.jit(device=True, forceinline=True)
def global_rows(array, base, row_stride, num_rows):
    """GlobalRows of a flat 16-bit array whose row i starts at element ``base + i * row_stride``."""
    return GlobalRows(ptx.global_address(array) + base * 2, row_stride * 2, num_rows)


@cuda.jit(device=True, forceinline=True)
def swizzle_phase(row, row_bytes):
    """What the 16-byte chunk index of ``row`` is XORed with: ``row % 8`` for 128-byte block
    rows, ``(row // 2) % 4`` for 64-byte ones (``row_bytes`` a compile-time constant)."""
    if row_bytes == 128:
        return row % 8
    return (row // 2) % 4


@cuda.jit(device=True, forceinline=True)
def swizzled_offset(row, chunk, tile_rows, row_bytes=128):
    """Byte offset of 16-byte ``chunk`` of ``row`` in a swizzled tile of ``tile_rows`` rows
    stored as column blocks of ``row_bytes``-byte rows (128 or 64, a compile-time constant)."""
    per_row = row_bytes // 16  # chunks per block row: 8 or 4
    phase = swizzle_phase(row, row_bytes)
    return (chunk // per_row) * (tile_rows * row_bytes) + row * row_bytes + ((chunk % per_row) ^ phase) * 16


@cuda.jit(device=True, forceinline=True)
def copy_tile_async(smem_tile, tile_rows, src, first_row, chunks_per_row, tid, num_threads, row_bytes=128):
    """Issue cp.async copies of rows ``first_row`` .. ``+ tile_rows`` of ``src`` (GlobalRows)
    into a swizzled shared tile of ``row_bytes``-byte block rows; rows past ``src.num_rows``
    are zero-filled and never read.

    Whole rows at a time when ``num_threads`` splits into groups of ``chunks_per_row`` whose
    count is a multiple of 8 (the swizzle period); otherwise (e.g. head_dim 96 or 256 over
    128 threads) one column block after the other, each a tile of ``row_bytes // 16`` chunks
    per row (``num_threads`` a multiple of 64 for 128-byte rows, of 32 for 64-byte rows)."""
    per_block = row_bytes // 16
    rows_per_pass = num_threads // chunks_per_row
    if num_threads % chunks_per_row == 0 and rows_per_pass % 8 == 0:
        copy_rows_async(smem_tile, tile_rows, src, first_row, chunks_per_row, tid, num_threads, row_bytes)
    else:
        for b in range(chunks_per_row // per_block):
            block = GlobalRows(src.address + b * row_bytes, src.stride, src.num_rows)
            copy_rows_async(smem_tile + b * (tile_rows * row_bytes), tile_rows, block, first_row, per_block,
                            tid, num_threads, row_bytes)


@cuda.jit(device=True, forceinline=True)
def copy_rows_async(smem_tile, tile_rows, src, first_row, chunks_per_row, tid, num_threads, row_bytes):
    """``copy_tile_async``, whole rows: thread ``tid`` copies chunk ``tid % chunks_per_row`` of
    rows ``tid // chunks_per_row`` + multiples of ``num_threads // chunks_per_row`` (a multiple
    of 8, so the swizzle pattern, and hence the shared offset step, is the same for each of its
    rows); when that step does not divide ``tile_rows``, the last pass copies only the rows
    that remain. The thread's global address starts at its first chunk and steps by a pass's
    rows (one 64-bit add a copy)."""
    rows_per_pass = num_threads // chunks_per_row
    passes = (tile_rows + rows_per_pass - 1) // rows_per_pass
    row = tid // chunks_per_row
    chunk = tid % chunks_per_row
    dst = smem_tile + swizzled_offset(row, chunk, tile_rows, row_bytes)
    at = src.address + (first_row + row) * src.stride + chunk * 16
    step = rows_per_pass * src.stride
    rows_left = uint32(max(min(src.num_rows - first_row, tile_rows), 0))  # rows of the tile that exist
    for i in range(passes):
        r = row + i * rows_per_pass
        to = dst + i * rows_per_pass * row_bytes
        if tile_rows % rows_per_pass == 0 or r < tile_rows:
            exists = uint32(r) < rows_left  # 32-bit compare
            ptx.cp_async_16_zfill_at(to, at if exists else src.address, exists)
        at += step


@cuda.jit(device=True, forceinline=True)
def drain_copies():
    """Wait for this thread's cp.async copies, then for every thread: after this, shared
    memory may be rewritten with ordinary stores. A CTA whose rows see no key runs no KV
    iteration, so without this its Q copy can still land on the staged output."""
    ptx.cp_async_wait_group_0()
    cuda.syncthreads()


@cuda.jit(device=True, forceinline=True)
def ldmatrix_offsets(offsets, row, half, row_bytes=128):
    """This lane's byte offsets for ldmatrix reads of 16-column blocks of a swizzled tile.

    The lane addresses ``row`` (any row congruent to it mod 8 reuses the pattern, at
    ``+row_bytes`` bytes per row) and the 8-column ``half`` (0 or 1) of 16-column block
    ``kb``: chunk ``2*kb + half``. Its offset is ``offsets[kb % 4]`` plus the start of
    64-column block ``kb // 4`` (128-byte rows; 64-byte rows: ``offsets[kb % 2]``, 32-column
    block ``kb // 2``): four (two) registers per lane, the rest immediates."""
    phase = swizzle_phase(row, row_bytes)
    for b in range(row_bytes // 32):
        offsets[b] = row * row_bytes + ((2 * b + half) ^ phase) * 16


@cuda.jit(device=True, forceinline=True)
def block_offset(offsets, kb, tile_rows, row_bytes=128):
    """Offset of 16-column block ``kb`` (compile-time constant) from ``ldmatrix_offsets``."""
    per_block = row_bytes // 32  # 16-column blocks per column block
    return offsets[kb % per_block] + (kb // per_block) * (tile_rows * row_bytes)


@cuda.jit(device=True, forceinline=True)
def load_a_fragments(frags, smem_tile, row0, k_tiles, tile_rows, lane, row_bytes=128):
    """ldmatrix the A operand (16 rows from ``row0``, ``k_tiles`` x 16 columns) of a
    row-major tile: ``frags[kt, 0:4]`` is the m16k16 A fragment of k-tile ``kt``."""
    row = row0 + lane % 16
    for kt in range(k_tiles):
        at = smem_tile + swizzled_offset(row, kt * 2 + lane // 16, tile_rows, row_bytes)
        ptx.ldmatrix_x4(frags[kt], at)
