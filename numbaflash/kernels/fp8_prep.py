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

from numba import cuda, int32, int64, uint32

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
    """The kernel for ``head_dim`` (a multiple of 4); parameters ``params.FP8_V``: V and Vt as
    4-byte words, V's batch, sequence and head strides in words. ``varlen``: packed sequences
    (``params.FP8_V_VARLEN``): V (total_k, heads_kv, head_dim), the int32 offsets
    ``cu_seqlens_k``, Vt (1, heads_kv, head_dim, keys) with sequence b's columns from
    ``vt_start(cu_seqlens_k[b], b)`` to the next sequence's (``fp8_layout.sequence_vt_start``):
    its keys, then zeros. grid.z is the sequence; each CTA takes its tiles run by run
    (grid.y runs at a time), so the columns are all written whatever grid.y the host chose."""
    W = head_dim // 4  # 4-byte words of a V row
    ROW = W + 1  # words of a shared row (padded by one)
    KT = KEYS_PER_CTA
    QUADS = KT // 4  # 4-key words of a Vt row segment
    TILE_WORDS = KT * ROW + 9
    READS = KT * W // THREADS  # words a thread reads: all issued before the first is stored
    RUN_KEYS = KT * TILE_RUN

    @cuda.jit(device=True, forceinline=True)
    def at(row):
        """The first word of key row ``row`` in the tile (rows shifted by 0, 1, 8, 9 per 32)."""
        return row * ROW + (row // 32) % 2 + 8 * ((row // 64) % 2)

    @cuda.jit(device=True, forceinline=True)
    def key_of(c):
        """``KEY_ORDER[c]`` (0 <= c < 32) by arithmetic (no table: a constant-memory table
        serialises when a warp's lanes read different entries)."""
        i = c % 4
        return 16 * (c // 16) + 8 * (i // 2) + 2 * ((c % 16) // 4) + i % 2

    @cuda.jit(device=True, forceinline=True)
    def byte(word, j):
        return (word >> uint32(8 * j)) & uint32(0xFF)

    @cuda.jit(device=True, forceinline=True)
    def transpose_tile(v, vt, row0, v_ss, seqlen, key0, out, keys, columns):
        """Keys key0 .. key0 + KT of one (sequence, KV head): V's rows from word ``row0`` (+ key
        * ``v_ss``; zero from ``seqlen`` on) -> Vt's head-dim rows, ``keys`` bytes apart, from
        byte ``out`` (key0's column), the columns below ``columns`` (relative to the sequence)."""
        tile = cuda.shared.array(TILE_WORDS, uint32)
        words = cuda.local.array(READS, uint32)
        tid = int32(cuda.threadIdx.x)
        for n in range(READS):  # read: word w of key row r (a warp: whole rows), all loads in flight
            i = tid + n * THREADS
            key = key0 + i // W
            words[n] = v[row0 + key * v_ss + i % W] if key < seqlen else uint32(0)
        for n in range(READS):
            i = tid + n * THREADS
            tile[at(i // W) + i % W] = words[n]
        cuda.syncthreads()
        for i in range(tid, W * QUADS, THREADS):  # keys c .. c + 3 of head-dim rows 4w .. 4w + 3
            q = int32(i % QUADS)
            w = int32(i // QUADS)
            c = 4 * q
            if key0 + c < columns:
                group = (c // KEY_GROUP) * KEY_GROUP
                k0 = tile[at(group + key_of(c % KEY_GROUP)) + w]
                k1 = tile[at(group + key_of(c % KEY_GROUP + 1)) + w]
                k2 = tile[at(group + key_of(c % KEY_GROUP + 2)) + w]
                k3 = tile[at(group + key_of(c % KEY_GROUP + 3)) + w]
                for j in range(4):  # head-dim column 4w + j: byte j of each key's word
                    word = byte(k0, j) | (byte(k1, j) << uint32(8)) | (byte(k2, j) << uint32(16)) | (
                        byte(k3, j) << uint32(24))
                    vt[(out + (4 * w + j) * keys + c) // 4] = word

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
