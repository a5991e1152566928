"""Tile helpers for the attention kernels: swizzled shared-memory tiles, cp.async tile
copies, ldmatrix fragment loads and the online-softmax steps.

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

import math
from collections import namedtuple

from numba import cuda, float32, uint32

from . import ptx

# Rows of a matrix in a flat global array: row i starts at ``array[base + i * row_stride]``;
# rows at or past ``num_rows`` lie outside it (loads zero-fill them, stores skip them).
GlobalRows = namedtuple("GlobalRows", ["array", "base", "row_stride", "num_rows"])
# Where one warp's score fragments sit, for masking: its first query row, the lane, the keys
# that exist, and the causal diagonal (query i sees key j iff j <= i + diag).
ScoreMask = namedtuple("ScoreMask", ["row_first", "lane", "seqlen_k", "diag"])

FULL_MASK = 0xFFFFFFFF
NEG_INF = float32(-math.inf)
LN2 = math.log(2.0)


@cuda.jit(device=True, inline="always")
def query_block(heads_q, group, reverse):
    """(query block, head, batch, kv head) of this CTA.

    Grid: x = query blocks, and (y, z) numbering the (batch, head) pairs head-fastest,
    ``hb = y + gridDim.y * z``: y and z are limited to 65535 each, so the host spreads the
    pairs over both (``forward_grid``); CTAs past the last pair get ``batch >= batch_size``
    and must return at once. With ``reverse`` (causal) the heaviest query blocks start
    first, for better tail balance. ``group`` query heads share one kv head (GQA); the
    divisions are 32-bit (no subroutine).
    """
    m_block = cuda.blockIdx.x
    if reverse:
        m_block = cuda.gridDim.x - 1 - m_block
    hb = uint32(cuda.blockIdx.y) + uint32(cuda.gridDim.y) * uint32(cuda.blockIdx.z)
    head = hb % uint32(heads_q)
    return m_block, head, hb // uint32(heads_q), head // uint32(group)


@cuda.jit(device=True, inline="always")
def visible_kv_tiles(m0, block_m, block_n, seqlen_k, diag, causal):
    """KV tiles a query block starting at row ``m0`` reads; causal stops after the tile that
    holds the last row's diagonal (query i sees keys j <= i + diag)."""
    n_tiles = (seqlen_k + block_n - 1) // block_n
    if causal:
        n_tiles = min(n_tiles, (m0 + block_m + diag + block_n - 1) // block_n)
    return n_tiles


@cuda.jit(device=True, inline="always")
def drain_copies():
    """Wait for this thread's cp.async copies, then for every thread: after this, shared
    memory may be rewritten with ordinary stores. A CTA whose rows see no key runs no KV
    iteration, so without this its Q copy can still land on the staged output."""
    ptx.cp_async_wait_group_0()
    cuda.syncthreads()


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


# ---------------------------------------------------------------------------------------------
# Online softmax on one 16-row m-tile of scores held as mma fragments: ``s[j, e]`` is this
# lane's element e of n-tile j (e = 0, 1: row g; e = 2, 3: row g + 8). Row "half" r = e // 2.
# The same layout is the accumulator of mma.sync m16n8k16 and, per warp, of wgmma m64nNk16.
# ---------------------------------------------------------------------------------------------


@cuda.jit(device=True, inline="always")
def mask_scores(s, n_tiles, col0, row0, lane, seqlen_k, diag, causal):
    """Set to -inf the scores of keys >= seqlen_k and, if ``causal``, of keys after the
    diagonal (query i sees key j iff j <= i + diag). ``col0``/``row0``: first key/query."""
    g = lane // 4
    t = lane % 4
    for j in range(n_tiles):
        for e in range(4):
            col = col0 + j * 8 + 2 * t + e % 2
            row = row0 + g + (e // 2) * 8
            if col >= seqlen_k or (causal and col > row + diag):
                s[j, e] = NEG_INF


@cuda.jit(device=True, inline="always")
def mask_if_needed(s, n_tiles, col0, block_n, at, causal):
    """``mask_scores`` for one warp's tile of ``block_n`` keys from ``col0`` (``at``: ScoreMask),
    only where the tile crosses the end of the keys or (causal) the diagonal."""
    if col0 + block_n > at.seqlen_k or (causal and col0 + block_n - 1 > at.row_first + at.diag):
        mask_scores(s, n_tiles, col0, at.row_first, at.lane, at.seqlen_k, at.diag, causal)


@cuda.jit(device=True, inline="always")
def scaled_row_maxes(s, n_tiles, mx, scale_log2):
    """``mx[r]`` = max over the quad's scores of row half r, times scale·log2(e)."""
    for r in range(2):
        mx[r] = row_max(s, n_tiles, r) * scale_log2


@cuda.jit(device=True, inline="always")
def max_grew(mx, m_run, threshold):
    """True if a row max exceeds the running one by more than ``threshold`` (log2 units)."""
    return mx[0] > m_run[0] + threshold or mx[1] > m_run[1] + threshold


@cuda.jit(device=True, inline="always")
def rescale_rows(acc_o, d_tiles, m_run, l_run, mx):
    """Adopt the new row maxes: scale O and the row sums by exp2(old - new)."""
    for r in range(2):
        m_new = max(m_run[r], mx[r])
        alpha = ptx.exp2(m_run[r] - m_new) if m_new != NEG_INF else float32(1.0)
        m_run[r] = m_new
        l_run[r] *= alpha
        for j in range(d_tiles):
            acc_o[j, 2 * r] *= alpha
            acc_o[j, 2 * r + 1] *= alpha


@cuda.jit(device=True, inline="always")
def exponentiate(s, n_tiles, m_run, l_run, scale_log2):
    """P = exp2(S·scale·log2(e) - m) in place (one FFMA + one ex2 per score), and add this
    lane's part of each row sum to ``l_run``. Rows with no key yet (m = -inf) give 0."""
    for r in range(2):
        m_use = m_run[r] if m_run[r] != NEG_INF else float32(0.0)
        row_sum = float32(0.0)
        for j in range(n_tiles):
            for e in range(2):
                p = ptx.exp2(s[j, 2 * r + e] * scale_log2 - m_use)
                s[j, 2 * r + e] = p
                row_sum += p
        l_run[r] += row_sum


@cuda.jit(device=True, inline="always")
def pack_p_fragments(p_frag, p, k_tiles, bf16):
    """P (fp32 fragments) -> 16-bit A fragments of the PV product, in registers: k-tile kt
    (16 keys) is S n-tiles 2kt and 2kt+1, which is exactly the m16k16 A layout."""
    for kt in range(k_tiles):
        for half in range(2):
            for r in range(2):
                lo = p[2 * kt + half, 2 * r]
                hi = p[2 * kt + half, 2 * r + 1]
                p_frag[kt, 2 * half + r] = ptx.pack_bf16x2(lo, hi) if bf16 else ptx.pack_f16x2(lo, hi)


@cuda.jit(device=True, inline="always")
def stage_output_rows(smem_tile, acc_o, d_tiles, tile_rows, row0, l_run, lane, bf16):
    """Normalise this warp's 16 O rows by their row sums and store them, 16-bit, into rows
    ``row0`` .. +15 of a swizzled shared tile. Returns nothing; the row sums (summed over
    the quad) are left in ``l_run``. Rows with a zero sum give 0."""
    g = lane // 4
    t = lane % 4
    for r in range(2):
        l_total = quad_sum(l_run[r])
        l_run[r] = l_total
        inv = ptx.reciprocal(l_total) if l_total > 0 else float32(0.0)
        for j in range(d_tiles):
            lo = acc_o[j, 2 * r] * inv
            hi = acc_o[j, 2 * r + 1] * inv
            packed = ptx.pack_bf16x2(lo, hi) if bf16 else ptx.pack_f16x2(lo, hi)
            offset = swizzled_offset(row0 + g + 8 * r, j, tile_rows) + 4 * t
            ptx.st_shared_b32(smem_tile + offset, packed)


@cuda.jit(device=True, inline="always")
def store_rows_global(dst, first_row, smem_tile, tile_rows, tile_row0, rows, chunks_per_row, lane, scratch):
    """A warp copies ``rows`` rows of a swizzled shared tile (from ``tile_row0``) to rows
    ``first_row`` ... of ``dst`` (GlobalRows) with 16-byte stores, skipping rows at or past
    ``dst.num_rows``. ``scratch`` is a uint32[4] register array."""
    for i in range(rows * chunks_per_row // 32):
        idx = lane + i * 32
        row = idx // chunks_per_row
        chunk = idx % chunks_per_row
        ptx.ld_shared_v4(scratch, smem_tile + swizzled_offset(tile_row0 + row, chunk, tile_rows))
        if first_row + row < dst.num_rows:
            ptx.st_global_v4(dst.array, dst.base + (first_row + row) * dst.row_stride + chunk * 8, scratch)


@cuda.jit(device=True, inline="always")
def store_lse(lse, lse_base, row0, num_rows, m_run, l_run, lane):
    """Write the log-sum-exp (natural log) of rows g and g+8 from ``row0``; -inf where the
    row sum (``l_run``, already quad-reduced) is 0. ``m_run`` is in scaled log2 units."""
    if lane % 4 == 0:
        for r in range(2):
            row = row0 + lane // 4 + 8 * r
            if row < num_rows:
                value = NEG_INF
                if l_run[r] > 0:
                    value = (m_run[r] + ptx.log2(l_run[r])) * float32(LN2)
                lse[lse_base + row] = value
