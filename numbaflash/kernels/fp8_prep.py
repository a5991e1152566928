"""The e4m3 Hopper forward's V, transposed for its PV product (``fp8_layout``): one pass over V.

V (batch, seqlen_k, heads_kv, head_dim) e4m3, any strides with the head dim contiguous ->
Vt (batch, heads_kv, head_dim, keys) contiguous, keys = seqlen_k rounded up to 32, the keys of
each 32 in ``fp8_layout.KEY_ORDER``, zero past seqlen_k.

A CTA of 256 threads takes ``KEYS_PER_CTA`` keys of one (batch, KV head). It reads their rows as
4-byte words (a warp reads whole rows: coalesced; each thread issues all its loads before it
stores the first, so that enough bytes are in flight to stream) into shared memory. Then each
thread takes four keys (the four bytes of one Vt word: keys ``KEY_ORDER[c .. c + 3]`` of their
group) and four
head-dim columns (one word of each key's row): four shared loads, a 4 x 4 byte transpose in
registers, four stores of whole words, a warp's 32 of each filling one 128-byte Vt row segment.
The shared rows are one word longer than a V row, and each 32-row group is shifted by 0, 1, 8 or
9 words: the 32 rows a warp's lanes read at once (keys 2t + ... of four groups) fall in 32
different banks. Grid: (heads_kv x ``TILE_RUN``, key tiles / ``TILE_RUN``, batch): the CTAs running
together take ``TILE_RUN`` consecutive key tiles of every head, so that they read whole rows of V
(every head of the same keys) and write runs of ``TILE_RUN`` x 128 bytes of each Vt row.

Packed sequences (``flash_attention_varlen``; the varlen build): V (total_k, heads_kv, head_dim)
-> Vt (1, heads_kv, head_dim, ``fp8_layout.packed_vt_keys``), sequence b's keys from column
``fp8_layout.sequence_vt_start(cu_seqlens_k[b], b)`` in the same order, zeros up to the next
sequence's first column; grid.z the sequence, each CTA looping over its sequence's runs.
"""

from __future__ import annotations

from numba import cuda, int64, uint32, uint64

from .. import ptx
from .fp8_layout import KEY_GROUP

KEYS_PER_CTA = 128
THREADS = 256
TILE_RUN = 8  # consecutive key tiles of one head among the CTAs that run together


@cuda.jit(device=True, forceinline=True)
def vt_start(start_k, sequence):
    """``fp8_layout.sequence_vt_start`` on the device (int64): a packed sequence's first column
    in the transposed V."""
    return (start_k + (KEY_GROUP - 1)) // KEY_GROUP * KEY_GROUP + KEY_GROUP * sequence


def make_transpose_v_kernel(head_dim: int, varlen: bool = False):
    """The kernel for ``head_dim`` (64, 128 or 256); parameters ``params.FP8_V``: V and Vt as 4-byte
    words, V's batch, sequence and head strides in words. ``varlen``: packed sequences
    (``params.FP8_V_VARLEN``): V (total_k, heads_kv, head_dim), the int32 offsets
    ``cu_seqlens_k``, Vt (1, heads_kv, head_dim, keys) with sequence b's columns from
    ``vt_start(cu_seqlens_k[b], b)`` to the next sequence's (``fp8_layout.sequence_vt_start``):
    its keys, then zeros. grid.z is the sequence; each CTA takes its tiles run by run
    (grid.y runs at a time), so the columns are all written whatever grid.y the host chose."""
    W = head_dim // 4  # 4-byte words of a V row
    ROW = W + 1  # words of a shared row (padded by one)
    KT = KEYS_PER_CTA
    QUADS = KT // 4  # 4-key words of a Vt row segment: one a lane
    TILE_WORDS = KT * ROW + 9
    READS = KT * W // THREADS  # words a thread reads: all issued before the first is stored
    ROWS_A_PASS = THREADS // W  # key rows the CTA reads a pass (whole rows: W divides 256)
    WORD_ROWS = W // (THREADS // QUADS)  # head-dim words a warp transposes (8 warps share the W)
    RUN_KEYS = KT * TILE_RUN
    assert QUADS == 32 and THREADS % W == 0 and W % (THREADS // QUADS) == 0

    @cuda.jit(device=True, forceinline=True)
    def at(row):
        """The first word of key row ``row`` in the tile (rows shifted by 0, 1, 8, 9 per 32)."""
        one = uint32(1)
        return row * uint32(ROW) + ((row >> uint32(5)) & one) + uint32(8) * ((row >> uint32(6)) & one)

    @cuda.jit(device=True, forceinline=True)
    def key_of(c):
        """``KEY_ORDER[c]`` (0 <= c < 32) by arithmetic (no table: a constant-memory table
        serialises when a warp's lanes read different entries)."""
        i = c & uint32(3)
        return (uint32(16) * (c >> uint32(4)) + uint32(8) * (i >> uint32(1))
                + uint32(2) * ((c & uint32(15)) >> uint32(2)) + (i & uint32(1)))

    @cuda.jit(device=True, forceinline=True)
    def transpose_tile(v, vt, row0, v_ss, seqlen, key0, out, keys, columns):
        """Keys key0 .. key0 + KT of one (sequence, KV head): V's rows from word ``row0`` (+ key
        * ``v_ss``; zero from ``seqlen`` on) -> Vt's head-dim rows, ``keys`` bytes apart, from
        byte ``out`` (key0's column, a multiple of 4), the columns below ``columns`` (relative to
        the sequence). Unsigned offsets throughout (no negative-index wraparound in the address
        arithmetic); a lane's four keys and their shared rows are the same for every word it
        transposes, and the 4 x 4 byte transpose is eight byte permutes."""
        tile = cuda.shared.array(TILE_WORDS, uint32)
        words = cuda.local.array(READS, uint32)
        tid = uint32(cuda.threadIdx.x)
        first_row = tid // uint32(W)  # read: word tid % W of rows first_row + n * ROWS_A_PASS
        col = tid % uint32(W)
        rows_left = seqlen - key0  # rows of this tile that hold keys (may be <= 0 or >= KT)
        address = uint64(row0 + (key0 + int64(first_row)) * v_ss + int64(col))
        step = uint64(ROWS_A_PASS * v_ss)
        for n in range(READS):  # every load in flight before the first shared store
            if int64(first_row + uint32(n * ROWS_A_PASS)) < rows_left:
                words[n] = v[address]
            else:
                words[n] = uint32(0)
            address += step
        for n in range(READS):
            tile[at(first_row + uint32(n * ROWS_A_PASS)) + col] = words[n]
        cuda.syncthreads()
        lane = tid % uint32(32)  # write: keys 4 lane .. + 3 (their order's) of head-dim words w
        c = uint32(4) * lane
        if key0 + int64(c) < columns:
            group = (c // uint32(KEY_GROUP)) * uint32(KEY_GROUP)
            r0 = at(group + key_of(c % uint32(KEY_GROUP)))
            r1 = at(group + key_of(c % uint32(KEY_GROUP) + uint32(1)))
            r2 = at(group + key_of(c % uint32(KEY_GROUP) + uint32(2)))
            r3 = at(group + key_of(c % uint32(KEY_GROUP) + uint32(3)))
            row_words = uint64(keys // 4)
            for m in range(WORD_ROWS):
                w = tid // uint32(32) + uint32(m * (THREADS // QUADS))
                k0, k1, k2, k3 = tile[r0 + w], tile[r1 + w], tile[r2 + w], tile[r3 + w]
                pairs_lo = ptx.byte_perm(k0, k1, uint32(0x5140))  # k0.0 k1.0 k0.1 k1.1
                pairs_hi = ptx.byte_perm(k0, k1, uint32(0x7362))  # k0.2 k1.2 k0.3 k1.3
                pairs2_lo = ptx.byte_perm(k2, k3, uint32(0x5140))
                pairs2_hi = ptx.byte_perm(k2, k3, uint32(0x7362))
                at_word = uint64(out // 4) + uint64(4 * w) * row_words + uint64(lane)
                vt[at_word] = ptx.byte_perm(pairs_lo, pairs2_lo, uint32(0x5410))  # column 4w: k0 k1 k2 k3
                vt[at_word + row_words] = ptx.byte_perm(pairs_lo, pairs2_lo, uint32(0x7632))
                vt[at_word + uint64(2) * row_words] = ptx.byte_perm(pairs_hi, pairs2_hi, uint32(0x5410))
                vt[at_word + uint64(3) * row_words] = ptx.byte_perm(pairs_hi, pairs2_hi, uint32(0x7632))

    def transpose_v(v, vt, v_sb, v_ss, v_sh, seqlen_k, keys, heads_kv):
        head = int64(cuda.blockIdx.x) % heads_kv
        key0 = (int64(cuda.blockIdx.y) * TILE_RUN + int64(cuda.blockIdx.x) // heads_kv) * KT
        if key0 >= keys:
            return  # past the last tile (the grid covers whole runs)
        batch = int64(cuda.blockIdx.z)
        out = (batch * heads_kv + head) * (W * 4) * keys + key0  # Vt's (batch, head, 0, key0), bytes
        transpose_tile(v, vt, batch * v_sb + head * v_sh, v_ss, seqlen_k, key0, out, keys, keys)

    def transpose_v_varlen(v, vt, cu_seqlens_k, v_ss, v_sh, keys, heads_kv):
        head = int64(cuda.blockIdx.x) % heads_kv
        sequence = int64(cuda.blockIdx.z)
        start = int64(cu_seqlens_k[sequence])
        end = int64(cu_seqlens_k[sequence + 1])
        first = vt_start(start, sequence)
        columns = vt_start(end, sequence + 1) - first  # this sequence's: its keys, then zeros
        row0 = start * v_ss + head * v_sh
        out = head * (W * 4) * keys + first
        key0 = (int64(cuda.blockIdx.y) * TILE_RUN + int64(cuda.blockIdx.x) // heads_kv) * KT
        while key0 < columns:  # uniform in the CTA
            transpose_tile(v, vt, row0, v_ss, end - start, key0, out + key0, keys, columns)
            key0 += int64(cuda.gridDim.y) * RUN_KEYS
            cuda.syncthreads()  # every thread has read the tile before the next tile's stores

    kernel = transpose_v_varlen if varlen else transpose_v
    kernel.__name__ = f"fp8_transpose_v_{'varlen_' if varlen else ''}d{head_dim}"
    # Four CTAs an SM (64 registers a thread); at head dim 256 two (32 loads in flight a thread).
    # The packed build's loop over tiles keeps the loads' addresses live across it: half as many.
    kernel.launch_bounds = (THREADS, (4 if head_dim <= 128 else 2) // (2 if varlen else 1))
    return kernel
