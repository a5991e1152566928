"""Decode against a KV cache on tensor cores (cp.async + ldmatrix + mma.sync, sm_80+; Hopper
included: decode streams K and V, and this kernel reads them 1-3% faster than SDPA cuDNN on an
H100, ``docs/PERFORMANCE.md``).

One CTA takes the packed query rows of one KV head (row r = query position r // group, query
head kv_head * group + r % group: the query heads of a KV head, times seqlen_q, fill the rows of
one tile, so K and V are read once per KV head) and one split of the keys (``decode_split``):
``num_splits`` CTAs share a (batch, KV head) when batch x heads_kv leaves SMs idle.

Key j of batch b comes from the cache when j < cache_seqlens[b], from the new rows (k_new,
v_new) at j - cache_seqlens[b] when those are given, and is masked at or past the total length
L = cache_seqlens[b] + seqlen_new; with causal masking query i sees keys j <= L - seqlen_q + i
(bottom-right). A paged cache maps key j to row j % page_size of page block_table[b, j //
page_size]; a CTA looks each key row's page up once, a tile ahead, and hands the row's K and V
addresses to the copying threads through shared memory (``make_page_table``). The CTA that loads
a new row also writes it into the cache (once: row block 0).

K and V tiles of ``block_n`` keys stream through a ring of ``stages`` swizzled shared tiles.
Each warp takes ``block_n / num_warps`` keys of every tile: S = Q K_wᵀ, its own online softmax,
O_w += P_w V_w. At the end the warps' (m, l, O) merge through shared memory (reusing the ring);
with one split the CTA writes O in the input dtype (and the LSE), else float32 partials of O and
their LSE, which ``make_decode_combine_kernel`` merges.

Two compile-time variants (issue 35), built only when a call asks for them, with the parameters
of ``params.DECODE_VARIANT`` (the plain kernel's, then the window's sides and the softcap's
factor): ``window`` (FlashAttention's sliding window: query i sees key j iff i + L - seqlen_q -
left <= j <= i + L - seqlen_q + right; a CTA reads only the key tiles its rows' windows reach,
``blocks.band_kv_tiles`` on the device from L, and its splits share those tiles only, so the cost
follows the window, not the cache; the new rows are appended into the cache by a pass of their
own, since the walk may skip their tiles) and ``softcap`` (scores tanh(QKᵀ · scale / softcap)
before the softmax, ``softmax.cap_scores``, whose exponent factor is then softcap·log2(e)).

A third, ``sink`` (a learnable sink, FlashAttention-4's ``learnable_sink``; ``params.SINK`` after
the plain or variant parameters), changes the warps' merge only: split 0 takes the sink's term
(exp2 of the logit over the merged max) into each row's sum, so its partial and LSE include it and
the combine kernel, which merges LSE-weighted partials, needs nothing of it; a row that sees no key
gives 0 and LSE = the sink. The walk is the plain kernel's.

Three more, the KV-cache call's options (FlashAttention's, issue 56; their parameters after the
others, ``params.decode_params``): ``batch_idx`` (sequence b's cache is the cache's row, or the
block table's, cache_batch_idx[b]) and ``leftpad`` (its key j is cache row cache_leftpad[b] + j,
its key count cache_seqlens[b] - cache_leftpad[b] + seqlen_new), both in where a sequence's rows
are (``make_sequence_source``); ``rotary`` (1 halves, 2 interleaved: ``make_rotary``) rotates Q in
shared memory once it lands and the new K rows as the threads load them, before the tile and the
cache get them.

The kernel is built from rooms: ``make_decode_rows`` (the row source: Q's packed rows, a dense or
paged cache and the appended rows), ``make_page_table`` (a paged cache's block table),
``make_decode_step`` (the ring's first tiles and the walk over the key tiles, on the forward's QK
and PV steps, online softmax and masker from ``mma_pieces``) and ``make_warp_stash`` (the first
half of the warps' merge); ``run_decode`` holds the prologue and the merge itself.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

from .. import ptx
from . import params
from .blocks import Band, band_kv_tiles
from .common import FULL_MASK, LN2, LOG2_E, NEG_INF, unroll
from .epilogue import log_sum_exp
from .mma_pieces import MmaShape, make_masker, make_online_softmax, make_pv_steps, make_qk_steps
from .shapes import DecodeConfig
from .smem import ldmatrix_offsets, swizzled_offset
from .softmax import pack_16bit, quad_sum, sink_logit

# One sequence's keys: batch b (its q, k_new and v_new rows), its cache rows, its total length
# (cache + new rows), its block table (paged: capacity is the page size, pages the table's row
# length), the cache's batch row (paged: the table's row) it reads and appends to, the cache
# row of its key 0 (``make_sequence_source``), and the rotary table (a RotaryTable; None but in
# rotary builds).
Sequence = namedtuple("Sequence", ["b", "cache_len", "total", "block_table", "bt_stride", "capacity",
                                   "pages", "page_magic", "page_shift", "cache_b", "start", "rotary"])
# A rotary build's table (``make_rotary``): cos and sin (16-bit bits of q's dtype, (rows, dim / 2)),
# the rotary dim (a multiple of 16, <= head_dim), the table's rows, and the query rows' position
# step (1: query i at cache_seqlens[b] + i; 0: every query at cache_seqlens[b]).
RotaryTable = namedtuple("RotaryTable", ["cos", "sin", "dim", "rows", "q_step"])
# Where one head's key (or value) rows are, in bytes: the cache and the new rows, each as an
# address and (batch or page, row) strides.
KeyRows = namedtuple("KeyRows", ["cache", "cache_sb", "cache_ss", "new", "new_sb", "new_ss"])

# Where one key row lives (``row_place``): below the total length, from the new rows, the
# cache unit (batch, or page) and row in it, the row in the new rows, and room in the cache.
RowPlace = namedtuple("RowPlace", ["exists", "from_new", "unit", "row", "new_row", "in_cache"])
# One combine warp's columns: its accumulator, the partials, this lane's split weight, the
# element of the row's first split in this lane's column, the last split's index.
CombineRow = namedtuple("CombineRow", ["acc", "o_part", "weight", "first", "last"])


# The plain kernel's parameters (``params.DECODE``), as the body (``run_decode``) takes them.
DecodeParams = namedtuple("DecodeParams", [
    "q", "k_cache", "v_cache", "k_new", "v_new", "cache_seqlens", "block_table", "out", "lse", "o_part",
    "lse_part", "q_sb", "q_ss", "q_sh", "kc_sb", "kc_ss", "kc_sh", "vc_sb", "vc_ss", "vc_sh", "kn_sb",
    "kn_ss", "kn_sh", "vn_sb", "vn_ss", "vn_sh", "o_sb", "o_ss", "o_sh", "seqlen_q", "seqlen_new", "capacity",
    "bt_stride", "pages", "page_magic", "page_shift", "heads_kv", "group", "row_blocks", "num_splits",
    "scale_log2", "write_lse"])


@cuda.jit(device=True, forceinline=True)
def decode_split(total_tiles, num_splits, split):
    """Key tiles [first, last) of split ``split`` of ``num_splits``: ceil(total / splits)
    consecutive tiles each, the last splits possibly empty (first >= last). From the device
    value of the sequence's length, so that one launch (one captured graph) serves any length.
    Invariant (``tests/test_decode_cpu.py``): the splits cover 0 .. total_tiles once, in order."""
    per_split = (total_tiles + num_splits - 1) // num_splits
    first = min(split * per_split, total_tiles)
    return first, min(first + per_split, total_tiles)


@cuda.jit(device=True, forceinline=True)
def window_tiles(total, seqlen_q, group, r0, rows, block_n, window_left, window_right):
    """Key tiles [first, end) that the packed query rows r0 .. r0 + rows - 1 (row r: query
    r // group; ``rows`` >= 1) of a sequence of ``total`` keys see under the sliding window
    (``window_left``, ``window_right``, each >= 0): ``blocks.band_kv_tiles`` over the block's
    queries, the window placed at the sequence's diagonal total - seqlen_q. Invariants
    (``tests/test_decode_cpu.py``): every key some row sees is in the range, its first and last
    tiles each hold one, and a block whose rows see no key gets an empty range."""
    pos_first = r0 // group
    pos_last = (r0 + rows - 1) // group
    diag = total - seqlen_q
    return band_kv_tiles(pos_first, pos_last - pos_first + 1, block_n,
                         Band(total, diag - window_left, diag + window_right))


# The row source's steps (``make_decode_rows``): the block table (a PageTable), the ring's wait, a
# tile's copy, Q's copy and (rotary builds) rotation, the window kernels' append.
DecodeRows = namedtuple("DecodeRows", ["pages", "wait_ring", "load_tiles", "prepare_q", "finish_q",
                                       "append_new_rows"])
# A paged cache's block table (``make_page_table``): the key rows a thread looks up a tile, the
# page of a key row, the look-ahead of a tile's rows and their publication in shared memory, and
# where a tile of consecutive rows starts.
PageTable = namedtuple("PageTable", ["rows", "page_index", "fetch_pages", "publish_pages", "tile_rows"])
# The walk over the key tiles (``make_decode_step``): the ring's first tiles, then the steps.
DecodeWalk = namedtuple("DecodeWalk", ["fill_ring", "walk"])
# What the walk over the key tiles (``make_decode_step``) reads: the split's tiles [first, last), the
# sequence and its key rows, the thread, whether to append, the block-table entries looked up a
# tile ahead (paged; ``fetch_pages``), the shared
# memory base and Q tile, the warp, the ldmatrix offsets, the fragments (S, O, Q, P, K/V), the
# softmax state, the two exponent factors and the keys the rows see (a RowKeys).
DecodeLoop = namedtuple("DecodeLoop", ["first", "last", "seq", "ks", "vs", "tid", "append", "pending",
                                       "base", "sq", "warp", "a_offsets", "k_offsets", "acc_s", "acc_o",
                                       "q_frag", "p_frag", "b_frag", "m_run", "l_run", "mx", "scale_log2",
                                       "cap_scale", "keys"])
# The keys a block's packed rows see (row r: query r // group), for the masker: the lane, the
# sequence's length and diagonal, the block's first row, the GQA group, the block's last query
# (window), the window's sides, and each fragment row's last and (window) first key (int64 (m_tiles, 2)).
RowKeys = namedtuple("RowKeys", ["lane", "total", "diag", "r0", "group", "pos_last", "left", "right", "upper",
                                 "lower"])
# Where the warps' merge writes (``make_warp_stash``, ``run_decode``): batch, KV head, split, the
# block's first packed row and the rows that exist, the warp and the lane.
MergeRows = namedtuple("MergeRows", ["b", "kv_head", "split", "r0", "rows_total", "warp", "lane"])


def decode_shape(config: DecodeConfig) -> MmaShape:
    """The pieces' shape of a decode config: every warp takes all the Q tile's m-tiles and its own
    ``block_n / num_warps`` keys of each K and V tile (from ``warp * keys`` rows in)."""
    return MmaShape(config.head_dim, config.rows, config.block_n, config.block_n // config.num_warps,
                    config.m_tiles, config.row_bytes, config.head_dim_v)


# The rotary steps (``make_rotary``): a new K row's 16-byte chunk loaded and rotated (and stored
# into a tile and the cache), Q's rows rotated in shared memory once they land.
Rotary = namedtuple("Rotary", ["load_new_chunk", "store_new_chunk", "finish_q"])


def make_rotary(config: DecodeConfig, rotary: int, bf16: bool) -> Rotary:
    """FlashAttention's rotary embedding of the KV-cache call (``rotary_cos``, ``rotary_sin``): the
    first ``table.dim`` columns of a row at position pos, in float32, rounded to the input dtype.
    ``rotary`` 1 (halves, GPT-NeoX; FlashAttention's ``rotary_interleaved=False``): column i <
    dim / 2 pairs with i + dim / 2, x1' = x1·cos - x2·sin, x2' = x2·cos + x1·sin, cos = cos[pos, i];
    2 (interleaved, GPT-J): columns 2i and 2i + 1 pair, with cos[pos, i]. A position past the
    table's rows takes its last row (the API checks that the table covers the cache). 16-byte
    chunks of 8 columns: dim a multiple of 16, so a chunk is all in the rotary columns or none."""
    ROTARY = rotary != 0
    INTERLEAVED = rotary == 2
    STAGES = config.stages
    # Wait until Q's copy group (the oldest, with the ring's STAGES - 1 first tiles after it) has landed.
    wait_for_q = ptx.CP_ASYNC_WAIT_GROUP[min(STAGES - 1, 3)]
    BF16 = bf16
    BM = config.rows
    RB = config.row_bytes
    THREADS = config.threads

    @cuda.jit(device=True, forceinline=True)
    def to_f32(bits):
        return ptx.f32_from_bf16_bits(bits) if BF16 else ptx.f32_from_f16_bits(bits)

    @cuda.jit(device=True, forceinline=True)
    def element(regs, e):
        """Element e (0..7) of a 16-byte chunk held as 4 uint32, as float32."""
        return to_f32((regs[e // 2] >> uint32(16 * (e % 2))) & uint32(0xFFFF))

    @cuda.jit(device=True, forceinline=True)
    def angle(table, pos, i):
        """(cos, sin) of pair i at position pos (clamped to the table)."""
        at = uint64(min(max(pos, int64(0)), table.rows - 1) * (table.dim // 2) + i)
        return to_f32(uint32(table.cos[at])), to_f32(uint32(table.sin[at]))

    @cuda.jit(device=True, forceinline=True)
    def rotate_chunks(x, y, col, pos, table):
        """Rotate in place: interleaved, chunk ``x`` of columns col .. col + 7 (``y`` unused);
        halves, ``x`` columns col .. col + 7 of the first half and ``y`` the same of the second."""
        new = cuda.local.array(16, float32)
        for e in range(8):
            if INTERLEAVED:
                c, s = angle(table, pos, col // 2 + e // 2)
                a, b = element(x, e - e % 2), element(x, e - e % 2 + 1)
                new[e] = a * c - b * s if e % 2 == 0 else b * c + a * s
            else:
                c, s = angle(table, pos, col + e)
                a, b = element(x, e), element(y, e)
                new[e] = a * c - b * s
                new[8 + e] = b * c + a * s
        for w in range(4):
            x[w] = pack_16bit(new[2 * w], new[2 * w + 1], BF16)
            if not INTERLEAVED:
                y[w] = pack_16bit(new[8 + 2 * w], new[8 + 2 * w + 1], BF16)

    @cuda.jit(device=True, forceinline=True)
    def load_new_chunk(regs, at, chunk, pos, table):
        """Chunk ``chunk`` of the new row at byte address ``at`` into ``regs`` (4 uint32), rotated
        at position ``pos`` where it holds rotary columns (halves: its partner chunk loaded too)."""
        ptx.ld_global_nc_v4_at(regs, at + chunk * 16)
        if chunk * 8 < table.dim:
            if INTERLEAVED:
                rotate_chunks(regs, regs, chunk * 8, pos, table)
            else:
                half = table.dim // 16  # chunks a half
                other = cuda.local.array(4, uint32)
                if chunk < half:
                    ptx.ld_global_nc_v4_at(other, at + (chunk + half) * 16)
                    rotate_chunks(regs, other, chunk * 8, pos, table)
                else:
                    ptx.ld_global_nc_v4_at(other, at + (chunk - half) * 16)
                    rotate_chunks(other, regs, (chunk - half) * 8, pos, table)

    @cuda.jit(device=True, forceinline=True)
    def store_new_chunk(dst, to_cache, at, chunk, pos, table):
        """``load_new_chunk``, then the chunk into the shared address ``dst`` and, where
        ``to_cache`` (the row's cache address) is not 0, into the cache."""
        regs = cuda.local.array(4, uint32)
        load_new_chunk(regs, at, chunk, pos, table)
        ptx.st_shared_v4(dst, regs)
        if to_cache != 0:
            ptx.st_global_v4_at(to_cache + chunk * 16, regs)

    @cuda.jit(device=True, forceinline=True)
    def rotate_q(sq, r0, rows_total, group, base, table, tid):
        """Rotate the rotary columns of the Q tile's packed rows in shared memory (row r: query
        r // group at position base + (r // group)·q_step); each thread a chunk (interleaved) or
        a chunk of each half (halves) of a row at a time."""
        items = table.dim // 8 if INTERLEAVED else table.dim // 16
        x = cuda.local.array(4, uint32)
        y = cuda.local.array(4, uint32)
        for idx in range(tid, BM * items, THREADS):
            row = idx // items
            c = idx % items
            if r0 + row < rows_total:
                pos = base + ((r0 + row) // group) * table.q_step
                ax = sq + swizzled_offset(row, c, BM, RB)
                ptx.ld_shared_v4(x, ax)
                if INTERLEAVED:
                    rotate_chunks(x, x, c * 8, pos, table)
                else:
                    ay = sq + swizzled_offset(row, c + items, BM, RB)
                    ptx.ld_shared_v4(y, ay)
                    rotate_chunks(x, y, c * 8, pos, table)
                    ptx.st_shared_v4(ay, y)
                ptx.st_shared_v4(ax, x)

    @cuda.jit(device=True, forceinline=True)
    def finish_q(sq, r0, rows_total, group, seq, tid):
        """Rotary builds, once the ring's first STAGES - 1 copy groups are issued after Q's own: wait
        for Q's (the oldest; the tiles stay in flight) and rotate it in place (``rotate_q``); the
        walk's first barrier orders it before use. Nothing in the other builds."""
        if ROTARY:
            wait_for_q()
            cuda.syncthreads()
            rotate_q(sq, r0, rows_total, group, seq.start + seq.cache_len, seq.rotary, tid)

    return Rotary(load_new_chunk, store_new_chunk, finish_q)


def make_page_table(config: DecodeConfig) -> PageTable:
    """A paged cache's block table (issue 58): each key row's page is looked up once a CTA, by
    one thread (thread t: rows t, t + threads, ... of a tile), a tile ahead of its copies, and
    the rows' K and V addresses are handed to the copying threads through shared memory (two
    buffers of ``block_n`` x 16 bytes at ``config.page_rows_at``, by tile parity). Before, each
    of a row's 16-byte chunks' threads looked its page up again: 1.7x the contiguous walk's
    instructions (docs/PERFORMANCE.md, "Paged caches at any page size")."""
    BN = config.block_n
    THREADS = config.threads
    PAGED = config.paged
    PAGE_TILES = config.page_tiles
    ROWS = 1 if PAGE_TILES else (BN + THREADS - 1) // THREADS  # key rows a thread looks up a tile

    @cuda.jit(device=True, forceinline=True)
    def page_index(j, seq):
        """j // page size (0 <= j < 2**31) by a multiply and a shift (``page_divider``)."""
        return int64((uint64(j) * uint64(seq.page_magic)) >> uint64(seq.page_shift))

    @cuda.jit(device=True, forceinline=True)
    def fetch_pages(pending, n0, seq, tid):
        """Paged: the block-table reads of the tile at key n0, each key row's once a CTA (thread t
        looks up rows t, t + THREADS, ...; not each 16-byte chunk's thread), into ``pending``
        (ROWS x 2 int32: the table entry, the row in its page). Issued a tile ahead of
        ``publish_pages``, which is the first to use the entries, so that the table's latency
        hides under a tile of work. Page tiles (``DecodeConfig.page_tiles``): the tile's one
        page, read by every thread (one address a warp), for the thread's own copies."""
        if PAGE_TILES:
            j = seq.start + n0
            page_of = page_index(j, seq)
            unit = int32(0)
            if page_of < seq.pages:
                unit = seq.block_table[uint64(seq.cache_b * seq.bt_stride + page_of)]
            pending[0, 0] = unit
            pending[0, 1] = int32(j - page_of * seq.capacity)
        elif PAGED:
            for i in range(ROWS):
                row = tid + i * THREADS
                if BN % THREADS == 0 or row < BN:
                    j = seq.start + n0 + row  # the key's row in the sequence's pages
                    page_of = page_index(j, seq)
                    unit = int32(0)
                    if page_of < seq.pages:
                        unit = seq.block_table[uint64(seq.cache_b * seq.bt_stride + page_of)]
                    pending[i, 0] = unit
                    pending[i, 1] = int32(j - page_of * seq.capacity)

    @cuda.jit(device=True, forceinline=True)
    def publish_pages(at, pending, ks, vs, tid):
        """Paged: the looked-up rows' addresses in the K and V caches (int64 each, a row's pair
        16 bytes) into the shared buffer at ``at``, for every thread's copies after the next
        barrier (a negative table entry reads page 0, never out of bounds). Page tiles: nothing
        (each thread's copies read its own look-up)."""
        if PAGED and not PAGE_TILES:
            pair = cuda.local.array(4, uint32)
            for i in range(ROWS):
                row = tid + i * THREADS
                if BN % THREADS == 0 or row < BN:
                    unit = int64(max(pending[i, 0], int32(0)))
                    r = int64(pending[i, 1])
                    k_off = ks.cache + unit * ks.cache_sb + r * ks.cache_ss
                    v_off = vs.cache + unit * vs.cache_sb + r * vs.cache_ss
                    pair[0] = uint32(k_off & 0xFFFFFFFF)
                    pair[1] = uint32(k_off >> 32)
                    pair[2] = uint32(v_off & 0xFFFFFFFF)
                    pair[3] = uint32(v_off >> 32)
                    ptx.st_shared_v4(at + row * 16, pair)

    @cuda.jit(device=True, forceinline=True)
    def tile_rows(n0, seq, pending):
        """(cache unit, row in it) of key n0's row where the tile's rows follow it in one unit:
        contiguous, the sequence's batch row; page tiles, the page ``fetch_pages`` left in
        ``pending`` (a negative table entry reads page 0). Not used when paged by rows."""
        if PAGE_TILES:
            return int64(max(pending[0, 0], int32(0))), int64(pending[0, 1])
        return seq.cache_b, seq.start + n0

    return PageTable(ROWS, page_index, fetch_pages, publish_pages, tile_rows)


def make_decode_rows(config: DecodeConfig, bf16: bool = False, rotary: int = 0,
                     v_in_k: bool = False) -> DecodeRows:
    """The row source: Q's packed rows, and the key rows of a dense or paged cache with the new
    rows appended (cp.async into the ring's swizzled K and V tiles). ``rotary`` (1: halves, 2:
    interleaved; ``make_rotary``): Q's rows and the new K rows are rotated at their positions,
    the new K rows loaded, rotated and stored by the threads (into the tile and the cache).
    ``v_in_k``: V is K's first ``value_dim`` columns (MLA's latent cache, ``mla_decode``): no V
    tile is copied (nor appended); the PV product reads K's tile. ``config`` a DecodeConfig or an
    ``MlaDecodeConfig``."""
    BN = config.block_n
    BM = config.rows
    THREADS = config.threads
    STAGES = config.stages
    CPR = config.head_dim // 8  # 16-byte chunks per row (of Q and K; a thread's slots walk them)
    CPR_V = config.value_dim // 8  # of V: a slot's chunk past them copies no V
    VALUE_DIM = CPR_V != CPR
    COPY_V = not v_in_k
    RB = config.row_bytes
    TILE_BYTES = BN * config.head_dim * 2  # K's tile: V's follows it
    Q_CHUNKS = BM * CPR
    KV_CHUNKS = BN * CPR
    # A thread's 16-byte chunks of a K (or V) tile: where its chunks divide the rows, one chunk
    # column and every (THREADS / CPR)-th row (ROW_WALK), else consecutive chunk indices.
    ROW_WALK = THREADS % CPR == 0 and BN % (THREADS // CPR) == 0
    SLOTS = BN // (THREADS // CPR) if ROW_WALK else KV_CHUNKS // THREADS
    # MLA's K tile (``v_in_k``; 72 chunks a row, which no thread count divides): thread t takes chunk
    # column t % 8 of every 128-byte column block of rows t // 8, + THREADS // 8, ...: its swizzle phase
    # (row % 8) and shared offsets are then the same for each, a constant apart, and a paged row's
    # address is read once for its 9 chunks (the general walk divided by 72 and re-read the address
    # for each chunk: about 2000 instructions a warp a tile, 7% of them mma.sync, under ncu).
    BLOCK_WALK = (v_in_k and not ROW_WALK and RB == 128 and THREADS % 8 == 0 and BN % (THREADS // 8) == 0
                  and CPR % 8 == 0)
    BLOCK_ROWS = BN // (THREADS // 8) if BLOCK_WALK else 0  # rows a thread copies a tile
    PAGED, BY_ROWS = config.paged, config.paged and not config.page_tiles  # BY_ROWS: addresses in smem
    ROTARY = rotary != 0
    load_new_chunk, store_new_chunk, finish_q = make_rotary(config, rotary, bf16)
    pages = make_page_table(config)
    page_index, tile_rows = pages.page_index, pages.tile_rows

    # Wait until at most STAGES - 2 copy groups are pending (the oldest tile has landed).
    wait_ring = ptx.CP_ASYNC_WAIT_GROUP[min(STAGES - 2, 3)]

    @cuda.jit(device=True, forceinline=True)
    def slot_of(i, tid):
        """(row, chunk) of this thread's i-th chunk of a K or V tile (``SLOTS`` of them)."""
        if ROW_WALK:
            return tid // CPR + i * (THREADS // CPR), tid % CPR
        idx = tid + i * THREADS
        return idx // CPR, idx % CPR

    @cuda.jit(device=True, forceinline=True)
    def load_cached_tiles(dst, n0, seq, ks, vs, tid, page_rows, pending):
        """cp.async of key rows n0 .. n0 + BN of K and V, all below the sequence's cache length
        (no masking, no new rows): from ``tile_rows`` on; paged by rows, at the rows' addresses
        that ``publish_pages`` placed at ``page_rows`` (shared)."""
        pair = cuda.local.array(4, uint32)
        unit, first_row = tile_rows(n0, seq, pending)  # row r: row first_row + r of unit
        if BLOCK_WALK:
            column = tid % 8
            for k in range(BLOCK_ROWS):
                row = tid // 8 + k * (THREADS // 8)
                if BY_ROWS:
                    ptx.ld_shared_v4(pair, page_rows + row * 16)
                    k_at = int64(uint64(pair[0]) | (uint64(pair[1]) << uint64(32)))
                else:
                    k_at = ks.cache + unit * ks.cache_sb + (first_row + row) * ks.cache_ss
                at = dst + row * RB + ((column ^ (row % 8)) * 16)
                for block in range(CPR // 8):
                    ptx.cp_async_16_at(at + block * (BN * RB), k_at + block * RB + column * 16)
            return
        for i in range(SLOTS):
            row, chunk = slot_of(i, tid)
            if BY_ROWS:
                ptx.ld_shared_v4(pair, page_rows + row * 16)
                k_at = int64(uint64(pair[0]) | (uint64(pair[1]) << uint64(32)))
                v_at = int64(uint64(pair[2]) | (uint64(pair[3]) << uint64(32)))
            else:
                k_at = ks.cache + unit * ks.cache_sb + (first_row + row) * ks.cache_ss
                v_at = vs.cache + unit * vs.cache_sb + (first_row + row) * vs.cache_ss
            at = dst + swizzled_offset(row, chunk, BN, RB)
            ptx.cp_async_16_at(at, k_at + chunk * 16)
            if COPY_V and (not VALUE_DIM or chunk < CPR_V):
                ptx.cp_async_16_at(at + TILE_BYTES, v_at + chunk * 16)

    @cuda.jit(device=True, forceinline=True)
    def load_tiles(dst, n0, seq, ks, vs, tid, append, page_rows, pending):
        """K and V rows n0 .. n0 + BN: the plain copy where every row is a cached one (paged: at
        ``page_rows`` or ``pending``), else row by row (masking past the length, new rows from
        k_new and v_new, appending)."""
        if n0 + BN <= seq.cache_len:
            load_cached_tiles(dst, n0, seq, ks, vs, tid, page_rows, pending)
        else:
            load_kv_tiles(dst, n0, seq, ks, vs, tid, append)

    @cuda.jit(device=True, forceinline=True)
    def row_place(j, seq):
        """Where key row j of ``seq`` lives (a RowPlace): cache row seq.start + j. 32-bit division
        by the page size: one per row and tile, shared by K and V."""
        at = seq.start + j
        if PAGED:
            page_of = page_index(at, seq)
            row = int64(at - page_of * seq.capacity)
            unit = int64(0)
            if int64(page_of) < seq.pages:
                unit = int64(seq.block_table[uint64(seq.cache_b * seq.bt_stride + int64(page_of))])
            in_cache = int64(page_of) < seq.pages and unit >= 0
        else:
            unit = seq.cache_b
            row = at
            in_cache = at < seq.capacity
        return RowPlace(j < seq.total, j >= seq.cache_len, unit, row, j - seq.cache_len, in_cache)

    @cuda.jit(device=True, forceinline=True)
    def row_address(src, place, b):
        """(byte address to load key row ``place`` of ``src`` (KeyRows) from, the cache address
        to write it to, or 0: only a new row that the cache has room for)."""
        cache_at = src.cache + place.unit * src.cache_sb + place.row * src.cache_ss
        if not place.exists:
            return src.cache, int64(0)
        if place.from_new:
            new_at = src.new + b * src.new_sb + place.new_row * src.new_ss
            return new_at, cache_at if place.in_cache else int64(0)
        return cache_at, int64(0)

    @cuda.jit(device=True, forceinline=True)
    def copy_row_chunk(dst, row, chunk, src, place, b, append):
        """cp.async of one 16-byte chunk of a key row into a swizzled tile (zero-filled past the
        sequence); with ``append``, a new row's chunk is also copied into the cache."""
        at, to_cache = row_address(src, place, b)
        ptx.cp_async_16_zfill_at(dst + swizzled_offset(row, chunk, BN, RB), at + chunk * 16, place.exists)
        if append and to_cache != 0:
            scratch = cuda.local.array(4, uint32)
            ptx.ld_global_nc_v4_at(scratch, at + chunk * 16)
            ptx.st_global_v4_at(to_cache + chunk * 16, scratch)

    @cuda.jit(device=True, forceinline=True)
    def load_kv_tiles(dst, n0, seq, ks, vs, tid, append):
        """cp.async of key rows n0 .. n0 + BN of K (into ``dst``) and V (``dst + TILE_BYTES``),
        each row placed once for K and V: rows past the length zero-filled, new rows from k_new
        and v_new (and, with ``append``, copied into the cache; rotary builds: K's rotated)."""
        for i in range(SLOTS):
            row, chunk = slot_of(i, tid)
            place = row_place(n0 + row, seq)
            if ROTARY and place.exists and place.from_new:  # at its cache row
                at, to_cache = row_address(ks, place, seq.b)
                store_new_chunk(dst + swizzled_offset(row, chunk, BN, RB), to_cache if append else int64(0),
                                at, chunk, seq.start + seq.cache_len + place.new_row, seq.rotary)
            else:
                copy_row_chunk(dst, row, chunk, ks, place, seq.b, append)
            if COPY_V and (not VALUE_DIM or chunk < CPR_V):
                copy_row_chunk(dst + TILE_BYTES, row, chunk, vs, place, seq.b, append)

    @cuda.jit(device=True, forceinline=True)
    def load_q_rows(dst, q_rows, kv_head, group, rows_total, r0, tid):
        """cp.async of the packed query rows r0 .. r0 + BM (row r: position r // group, head
        kv_head * group + r % group; ``q_rows``: (byte address of the batch's q, position
        stride, head stride in bytes)) into a swizzled tile; rows past ``rows_total`` zero-filled."""
        q_addr, q_ss, q_sh = q_rows
        for i in range((Q_CHUNKS + THREADS - 1) // THREADS):
            idx = tid + i * THREADS
            if Q_CHUNKS % THREADS == 0 or idx < Q_CHUNKS:
                row = idx // CPR
                chunk = idx % CPR
                r = r0 + row
                exists = r < rows_total
                pos = r // group
                at = q_addr + pos * q_ss + (kv_head * group + r - pos * group) * q_sh + chunk * 16
                ptx.cp_async_16_zfill_at(dst + swizzled_offset(row, chunk, BM, RB), at if exists else q_addr,
                                         exists)

    @cuda.jit(device=True, forceinline=True)
    def append_new_rows(seq, ks, vs, seqlen_new, split, num_splits, tid):
        """Window kernels (row block 0): write this split's new rows (split, split + num_splits,
        ...) of k_new and v_new into the cache (where it has room), 16 bytes a thread at a time.
        The walk does not append there: it may skip the tiles of new rows below the window."""
        mine = (seqlen_new - split + num_splits - 1) // num_splits
        scratch = cuda.local.array(4, uint32)
        for idx in range(tid, mine * CPR, THREADS):
            chunk = idx % CPR
            place = row_place(seq.cache_len + split + (idx // CPR) * num_splits, seq)
            at, to_cache = row_address(ks, place, seq.b)
            if to_cache != 0:
                if ROTARY:  # at its cache row
                    load_new_chunk(scratch, at, chunk, seq.start + seq.cache_len + place.new_row, seq.rotary)
                else:
                    ptx.ld_global_nc_v4_at(scratch, at + chunk * 16)
                ptx.st_global_v4_at(to_cache + chunk * 16, scratch)
            at, to_cache = row_address(vs, place, seq.b)
            if COPY_V and to_cache != 0 and (not VALUE_DIM or chunk < CPR_V):
                ptx.ld_global_nc_v4_at(scratch, at + chunk * 16)
                ptx.st_global_v4_at(to_cache + chunk * 16, scratch)

    @cuda.jit(device=True, forceinline=True)
    def prepare_q(dst, q_rows, kv_head, group, rows_total, r0, tid):
        """``load_q_rows``; rotary builds commit Q as a copy group of its own (``finish_q``)."""
        load_q_rows(dst, q_rows, kv_head, group, rows_total, r0, tid)
        if ROTARY:
            ptx.cp_async_commit_group()

    return DecodeRows(pages, wait_ring, load_tiles, prepare_q, finish_q, append_new_rows)


def make_sequence_source(batch_idx: bool, leftpad: bool):
    """Where each sequence's keys are: ``sequence_of(p, b, cache_batch_idx, cache_leftpad,
    rotary)``, the Sequence of batch b (``p``: a DecodeParams; ``rotary``: a RotaryTable or None),
    read on the device (a captured graph follows the values). ``batch_idx`` (FlashAttention's
    ``cache_batch_idx``, int32 (batch,)): its cache is the cache's batch row (paged: the block
    table's row) cache_batch_idx[b], else b. ``leftpad`` (``cache_leftpad``, int32 (batch,), 0 <=
    cache_leftpad[b] <= cache_seqlens[b]): its keys start at cache row cache_leftpad[b], else 0:
    key j is cache row cache_leftpad[b] + j, the cache holds cache_seqlens[b] - cache_leftpad[b]
    of its keys, the new rows are appended from cache row cache_seqlens[b] on, and the causal
    diagonal and the window follow its key count L = cache_seqlens[b] - cache_leftpad[b] +
    seqlen_new. The plain build's is b and 0."""
    BATCH_IDX = batch_idx
    LEFTPAD = leftpad

    @cuda.jit(device=True, forceinline=True)
    def sequence_of(p, b, cache_batch_idx, cache_leftpad, rotary):
        cache_b = b
        if BATCH_IDX:
            cache_b = int64(cache_batch_idx[uint64(b)])
        start = int64(0)
        if LEFTPAD:
            start = int64(cache_leftpad[uint64(b)])
        cache_len = int64(p.cache_seqlens[uint64(b)]) - start
        return Sequence(b, cache_len, cache_len + p.seqlen_new, p.block_table, p.bt_stride, p.capacity,
                        p.pages, p.page_magic, p.page_shift, cache_b, start, rotary)

    return sequence_of


def make_decode_step(config: DecodeConfig, causal: bool, bf16: bool, window: bool, softcap: bool,
                     rows: DecodeRows):
    """The walk over the split's key tiles: ``fill_ring`` copies the first stages - 1 tiles, then
    ``walk(loop)`` (``loop``: a DecodeLoop), for each tile t, waits for it, (paged) publishes tile
    t + stages - 1's looked-up rows, starts that tile's copy and the next one's look-up, then the
    warp's S = Q K_wᵀ, softcap and masks, online softmax and O_w += P_w V_w, on the forward's
    pieces (``mma_pieces``: the warp's keys are key slice ``warp`` of each tile)."""
    shape = decode_shape(config)
    BN = config.block_n
    KW = shape.keys  # keys of a tile each warp takes
    STAGES = config.stages
    TILE_BYTES = BN * config.head_dim * 2  # K's tile: V's follows it
    STAGE_BYTES = config.stage_bytes  # K then V
    SRING = config.rows * config.head_dim * 2
    D_K_TILES = config.head_dim // 16
    Q_REGS = q_in_registers(config)
    SOFTCAP = softcap
    CAUSAL = causal
    WINDOW = window
    qk = make_qk_steps(shape, Q_REGS, False, bf16)
    pv = make_pv_steps(shape, False, bf16)
    softmax = make_online_softmax(shape, bf16, pv, False)
    load_q_slice, qk_scores, pv_accumulate = qk.load_q_slice, qk.qk_scores, pv.pv_accumulate
    cap, refresh_row_maxes = softmax.cap, softmax.refresh_row_maxes
    exponentiate_tile = softmax.exponentiate_tile
    mask_rows = make_masker(shape, causal, window).mask_rows
    wait_ring, load_tiles = rows.wait_ring, rows.load_tiles
    fetch_pages, publish_pages = rows.pages.fetch_pages, rows.pages.publish_pages
    PAGED = config.paged
    PAGE_TILES = config.page_tiles
    PAGE_ROWS_AT = config.page_rows_at  # paged: two buffers of the key rows' offsets, by tile parity
    PAGE_BUFFER = config.block_n * 16

    @cuda.jit(device=True, forceinline=True)
    def mask_keys(acc_s, key0, rk):
        """The masker's ``mask_rows`` on this warp's keys from ``key0`` (``rk``: a RowKeys), where
        they cross the end of the keys, the first row's upper edge or the last row's lower edge."""
        if WINDOW:
            if (key0 + KW > rk.total or key0 + KW - 1 > rk.diag + rk.r0 // rk.group + rk.right
                    or key0 < rk.diag + rk.pos_last - rk.left):
                mask_rows(acc_s, key0, rk.lane, rk.total, rk.upper, rk.lower)
        elif key0 + KW > rk.total or (CAUSAL and key0 + KW - 1 > rk.diag + rk.r0 // rk.group):
            mask_rows(acc_s, key0, rk.lane, rk.total, rk.upper, rk.lower)

    @cuda.jit(device=True, forceinline=True)
    def fill_ring(base, first, last, seq, ks, vs, tid, append, pending):
        """The ring's first STAGES - 1 tiles, a copy group each, and (paged) the next tile's
        block-table look-ahead into ``pending``, for the walk's first step."""
        for s in range(STAGES - 1):
            if first + s < last:
                ring = base + SRING + s * STAGE_BYTES
                n0 = (first + s) * BN
                page_rows = base + PAGE_ROWS_AT + (s % 2) * PAGE_BUFFER
                if PAGED:  # the buffer was last read before the previous tile's barrier
                    fetch_pages(pending, n0, seq, tid)
                    if not PAGE_TILES:  # page tiles: each thread reads its own look-up
                        publish_pages(page_rows, pending, ks, vs, tid)
                        cuda.syncthreads()
                load_tiles(ring, n0, seq, ks, vs, tid, append, page_rows, pending)
            ptx.cp_async_commit_group()
        if first + STAGES - 1 < last:
            fetch_pages(pending, (first + STAGES - 1) * BN, seq, tid)

    @cuda.jit(device=True, forceinline=True)
    def walk(loop):
        first, last = loop.first, loop.last
        base, warp, a_offsets = loop.base, loop.warp, loop.a_offsets
        acc_s, acc_o, p_frag, b_frag = loop.acc_s, loop.acc_o, loop.p_frag, loop.b_frag
        m_run, l_run, scale_log2 = loop.m_run, loop.l_run, loop.scale_log2
        for t in range(first, last):
            stage = (t - first) % STAGES
            wait_ring()  # tile t (and Q) have landed ...
            nxt = t + STAGES - 1
            page_rows = base + PAGE_ROWS_AT + ((nxt - first) % 2) * PAGE_BUFFER
            if PAGED and nxt < last:  # tile nxt's rows, looked up a tile ago, for the copies below
                publish_pages(page_rows, loop.pending, loop.ks, loop.vs, loop.tid)
            cuda.syncthreads()  # ... for everyone, and everyone is done with tile t - 1's stage
            if Q_REGS and t == first:
                for kt in range(D_K_TILES):  # every m-tile and k-tile of the Q tile into registers
                    load_q_slice(loop.q_frag, kt, loop.sq, a_offsets, kt)
            if nxt < last:
                ring = base + SRING + ((nxt - first) % STAGES) * STAGE_BYTES
                load_tiles(ring, nxt * BN, loop.seq, loop.ks, loop.vs, loop.tid, loop.append, page_rows,
                           loop.pending)
                if nxt + 1 < last:
                    fetch_pages(loop.pending, (nxt + 1) * BN, loop.seq, loop.tid)
            ptx.cp_async_commit_group()
            sk = base + SRING + stage * STAGE_BYTES
            qk_scores(acc_s, loop.q_frag, loop.sq, a_offsets, sk, loop.k_offsets, b_frag, warp)
            key0 = t * BN + warp * KW
            if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
                cap(acc_s, loop.cap_scale)
            mask_keys(acc_s, key0, loop.keys)
            refresh_row_maxes(acc_s, acc_o, m_run, l_run, loop.mx, scale_log2)
            exponentiate_tile(acc_s, p_frag, m_run, l_run, scale_log2)
            pv_accumulate(acc_o, p_frag, sk + TILE_BYTES, a_offsets, b_frag, warp)

    return DecodeWalk(fill_ring, walk)


def make_warp_stash(config: DecodeConfig):
    """The first half of the warps' merge, ``stash(smem_f, acc_o, m_run, l_run, at)`` (``at``: a
    MergeRows): once every copy has landed, each warp writes its m, l (quad-summed) and
    unnormalised O (float32) into shared memory over the ring (``stash_layout``), for the rows
    that exist (4 of 16 at GQA 4 and seqlen_q 1). O's rows are ``merge_row`` floats apart, 8 mod
    32: the 8 rows of a store fall on 4 bank groups, not on one (a row stride of D made every O
    store an 8-way bank conflict under ncu)."""
    BM = config.rows
    MT = config.m_tiles
    OS = config.merge_row  # floats from one O row to the next
    D_N_TILES = config.value_dim // 8  # of O
    O_AT, ML_AT = stash_layout(config)

    @cuda.jit(device=True, forceinline=True)
    def stash(smem_f, acc_o, m_run, l_run, at):
        ptx.cp_async_wait_group_0()
        cuda.syncthreads()
        g = at.lane // 4
        for mt in range(MT):
            for r in range(2):
                row = 16 * mt + g + 8 * r
                l_sum = quad_sum(l_run[mt, r])
                if at.r0 + row < at.rows_total:
                    if at.lane % 4 == 0:
                        smem_f[ML_AT + (at.warp * BM + row) * 2] = m_run[mt, r]
                        smem_f[ML_AT + (at.warp * BM + row) * 2 + 1] = l_sum
                    for j in range(D_N_TILES):
                        for e in range(2):
                            col = 8 * j + 2 * (at.lane % 4) + e
                            smem_f[O_AT + (at.warp * BM + row) * OS + col] = acc_o[mt, j, 2 * r + e]
        cuda.syncthreads()

    return stash


def stash_layout(config: DecodeConfig) -> tuple[int, int]:
    """Where the warps' merge keeps its float32 values (indices of the dynamic shared memory as
    float32, over the ring): O at [warps][rows][merge_row], then (m scaled log2, l) at
    [warps][rows][2]."""
    o_at = config.rows * config.head_dim * 2 // 4
    return o_at, o_at + config.num_warps * config.rows * config.merge_row


def q_in_registers(config: DecodeConfig) -> bool:
    """Q's fragments stay in registers across the walk where they are few (d <= 128 at 16 rows)."""
    return config.m_tiles * (config.head_dim // 16) <= 8


def decode_entry(run_decode, variant: bool, sink: bool = False, batch_idx: bool = False,
                 leftpad: bool = False, rotary: int = 0):
    """The decode kernel's entry function around its body ``run_decode(p, window_left,
    window_right, cap_scale, sink, cache_batch_idx, cache_leftpad, rotary)``: parameters
    ``DecodeParams``' fields in order (``params.DECODE``), then for a ``variant`` ``window_left,
    window_right, cap_scale`` (``params.DECODE_VARIANT``; the plain kernel passes 0, 0, 0.0), then
    for a ``sink`` build ``sink``, for a ``batch_idx`` build ``cache_batch_idx``, for a ``leftpad``
    build ``cache_leftpad``, for a ``rotary`` build ``params.ROTARY``'s five, passed as a
    RotaryTable (``params.decode_params``; each None where not built). Generated from the one
    list of names, so that the parameters are written once; named ``flash_decode`` or
    ``flash_decode_variant``."""
    rest = "window_left, window_right, cap_scale" if variant else "int64(0), int64(0), float32(0.0)"
    table = f"RotaryTable({', '.join(params.names_of(params.ROTARY))})"
    options = ", ".join(name if built else "None" for name, built in
                        (("sink", sink), ("cache_batch_idx", batch_idx), ("cache_leftpad", leftpad),
                         (table, rotary)))
    return params.entry("flash_decode_variant" if variant else "flash_decode",
                        params.decode_params(variant, sink, batch_idx, leftpad, bool(rotary)),
                        f"run_decode(DecodeParams({', '.join(DecodeParams._fields)}), {rest}, {options})",
                        {"run_decode": run_decode, "DecodeParams": DecodeParams, "RotaryTable": RotaryTable,
                         "int64": int64, "float32": float32})


def make_decode_kernel(config: DecodeConfig, causal: bool, bf16: bool, window: bool = False,
                       softcap: bool = False, sink: bool = False, batch_idx: bool = False,
                       leftpad: bool = False, rotary: int = 0):
    """The decode kernel (``params.DECODE``): grid (num_splits, row_blocks * heads_kv, batch),
    ``config.threads`` threads, ``config.shared_bytes`` of dynamic shared memory. ``window`` or
    ``softcap``: a variant (``params.DECODE_VARIANT``: window_left, window_right, cap_scale
    after the plain parameters; ``scale_log2`` is then softcap·log2(e) with a softcap); a window
    kernel's ``causal`` must be False (its right side 0 is causal masking). ``sink``: a learnable
    sink's build (``params.SINK`` last), which split 0's merge takes into each row. ``batch_idx``,
    ``leftpad``, ``rotary``: the builds of the KV-cache call's ``cache_batch_idx``,
    ``cache_leftpad`` (``make_sequence_source``) and rotary embedding (1: halves, 2: interleaved;
    ``make_rotary``), their parameters after the others (``params.decode_params``)."""
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    config.check()
    D, DV = config.head_dim, config.value_dim  # DV: O's columns (V's head dim)
    BN = config.block_n
    BM = config.rows
    MT = config.m_tiles
    RB = config.row_bytes
    D_K_TILES = D // 16
    D_N_TILES = DV // 8
    S_N_TILES = decode_shape(config).keys // 8
    P_K_TILES = decode_shape(config).keys // 16
    SQ = 0  # the Q tile's offset in shared memory, then the ring's (``make_decode_step``)
    Q_REGS = q_in_registers(config)
    WINDOW = window
    SINK = sink
    rows = make_decode_rows(config, bf16, rotary)
    PAGE_ROWS = rows.pages.rows
    prepare_q, finish_q, append_new_rows = rows.prepare_q, rows.finish_q, rows.append_new_rows
    fill_ring, walk = make_decode_step(config, causal, bf16, window, softcap, rows)
    sequence_of = make_sequence_source(batch_idx, leftpad)
    stash = make_warp_stash(config)
    WARPS = config.num_warps
    OS = config.merge_row  # the warps' merge: floats from one O row to the next
    O_AT, ML_AT = stash_layout(config)
    THREADS = config.threads
    CPR = DV // 8  # 16-byte chunks per O row (the merge's)
    BF16 = bf16

    @cuda.jit(device=True, forceinline=True)
    def run_decode(p, window_left, window_right, cap_scale, sink, cache_batch_idx, cache_leftpad, rotary):
        """The kernel's body: ``p`` a DecodeParams (the plain kernel's parameters); the window's
        sides and softmax_scale / softcap (read by the variants only); the sink's logits (sink
        builds only); the cache options' arrays and the rotary table (their builds only)."""
        smem = cuda.shared.array(0, types.uint16)
        smem_f = cuda.shared.array(0, float32)  # the same dynamic shared memory, as float32
        tid = cuda.threadIdx.x & 1023
        warp = tid // 32
        lane = tid % 32
        split = int64(cuda.blockIdx.x)
        kv_head = int64(cuda.blockIdx.y) % p.heads_kv
        row_block = int64(cuda.blockIdx.y) // p.heads_kv
        b = int64(cuda.blockIdx.z)
        rows_total = p.group * p.seqlen_q
        r0 = row_block * BM
        ptx.grid_dependency_wait()  # sm_90 launches this kernel programmatically: inputs after this
        seq = sequence_of(p, b, cache_batch_idx, cache_leftpad, rotary)
        total = seq.total
        diag = total - p.seqlen_q  # query i sees keys j <= i + diag
        pos_last = int64(0)  # the block's last query (window kernels only)
        if WINDOW:  # the key tiles the rows' windows reach, from this sequence's length, split
            pos_last = (min(r0 + BM, rows_total) - 1) // p.group
            kv_first, kv_end = window_tiles(total, p.seqlen_q, p.group, r0, min(BM, rows_total - r0), BN,
                                            window_left, window_right)
            first, last = decode_split(kv_end - kv_first, p.num_splits, split)
            first += kv_first
            last += kv_first
        else:
            first, last = decode_split((total + BN - 1) // BN, p.num_splits, split)
        append = p.seqlen_new > 0 and row_block == 0 and not WINDOW

        base = ptx.shared_address_u16(smem)
        sq = base + SQ
        q_addr = ptx.global_address(p.q)
        ks = KeyRows(ptx.global_address(p.k_cache) + kv_head * p.kc_sh * 2, p.kc_sb * 2, p.kc_ss * 2,
                     ptx.global_address(p.k_new) + kv_head * p.kn_sh * 2, p.kn_sb * 2, p.kn_ss * 2)
        vs = KeyRows(ptx.global_address(p.v_cache) + kv_head * p.vc_sh * 2, p.vc_sb * 2, p.vc_ss * 2,
                     ptx.global_address(p.v_new) + kv_head * p.vn_sh * 2, p.vn_sb * 2, p.vn_ss * 2)

        if WINDOW and p.seqlen_new > 0 and row_block == 0:
            append_new_rows(seq, ks, vs, p.seqlen_new, split, p.num_splits, tid)
        # Q goes in the first tile's copy group: the walk's first wait covers both (rotary: finish_q).
        prepare_q(sq, (q_addr + b * p.q_sb * 2, p.q_ss * 2, p.q_sh * 2), kv_head, p.group, rows_total, r0,
                  tid)
        pending = cuda.local.array((PAGE_ROWS, 2), int32)  # paged: the next tile's block-table entries
        fill_ring(base, first, last, seq, ks, vs, tid, append, pending)
        finish_q(sq, r0, rows_total, p.group, seq, tid)

        acc_o = cuda.local.array((MT, D_N_TILES, 4), float32)
        for mt in range(MT):
            for j in range(D_N_TILES):
                for e in range(4):
                    acc_o[mt, j, e] = 0.0
        acc_s = cuda.local.array((MT, S_N_TILES, 4), float32)
        q_frag = cuda.local.array((MT, D_K_TILES if Q_REGS else 1, 4), uint32)
        p_frag = cuda.local.array((MT, P_K_TILES, 4), uint32)
        b_frag = cuda.local.array((1, 4), uint32)  # K or V fragments (one buffer)
        m_run = cuda.local.array((MT, 2), float32)
        l_run = cuda.local.array((MT, 2), float32)
        mx = cuda.local.array((MT, 2), float32)
        limit = cuda.local.array((MT, 2), int64)  # causal: the last key each fragment row sees
        lower = cuda.local.array((MT, 2), int64)  # window: the first key each fragment row sees
        for mt in range(MT):
            for r in range(2):
                m_run[mt, r] = NEG_INF
                l_run[mt, r] = 0.0
                limit[mt, r] = diag + (r0 + 16 * mt + lane // 4 + 8 * r) // p.group
                if WINDOW:
                    lower[mt, r] = limit[mt, r] - window_left
                    limit[mt, r] += window_right
        a_offsets = cuda.local.array(4, uint32)  # Q as the A operand, V as the B operand of PV
        ldmatrix_offsets(a_offsets, lane % 16, lane // 16, RB)
        k_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(k_offsets, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB)

        loop = DecodeLoop(first, last, seq, ks, vs, tid, append, pending, base, sq, warp, a_offsets,
                          k_offsets, acc_s, acc_o, q_frag, p_frag, b_frag, m_run, l_run, mx, p.scale_log2,
                          cap_scale, RowKeys(lane, total, diag, r0, p.group, pos_last, window_left,
                                             window_right, limit, lower if WINDOW else limit))
        walk(loop)

        ptx.grid_launch_dependents()  # the combine kernel (sm_90: launched programmatically) may start
        at = MergeRows(b, kv_head, split, r0, rows_total, warp, lane)
        stash(smem_f, acc_o, m_run, l_run, at)
        # Then thread t merges 8 consecutive columns of a row and writes O (one split: in the input
        # dtype, and the LSE) or the split's float32 partials and LSE.
        heads_q = p.heads_kv * p.group
        for i in range((BM * CPR + THREADS - 1) // THREADS):
            idx = tid + i * THREADS
            row = idx // CPR
            chunk = idx % CPR
            r = r0 + row
            if idx < BM * CPR and r < rows_total:
                m_max = NEG_INF
                for w in range(WARPS):
                    m_max = max(m_max, smem_f[ML_AT + (w * BM + row) * 2])
                logit = NEG_INF  # the sink's (split 0 of a sink build), in the merge's log2 units
                if SINK:
                    if split == 0:
                        logit = sink_logit(sink, kv_head * p.group + r % p.group)
                        m_max = max(m_max, logit)
                l_all = float32(0.0)
                acc = cuda.local.array(8, float32)
                for c in range(8):
                    acc[c] = 0.0
                if m_max != NEG_INF:
                    for w in range(WARPS):
                        weight = ptx.exp2(smem_f[ML_AT + (w * BM + row) * 2] - m_max)
                        l_all += weight * smem_f[ML_AT + (w * BM + row) * 2 + 1]
                        for c in range(8):
                            acc[c] += weight * smem_f[O_AT + (w * BM + row) * OS + chunk * 8 + c]
                if SINK:
                    if logit != NEG_INF:
                        l_all += ptx.exp2(logit - m_max)
                inv = float32(1.0) / l_all if l_all > 0 else float32(0.0)
                lse_value = log_sum_exp(m_max, l_all)
                pos = r // p.group
                head = kv_head * p.group + r - pos * p.group
                if p.num_splits == 1:
                    packed = cuda.local.array(4, uint32)
                    for c in range(4):
                        packed[c] = pack_16bit(acc[2 * c] * inv, acc[2 * c + 1] * inv, BF16)
                    at = (ptx.global_address(p.out) + (b * p.o_sb + pos * p.o_ss + head * p.o_sh) * 2
                          + chunk * 16)
                    ptx.st_global_v4_at(at, packed)
                    if p.write_lse and chunk == 0:
                        p.lse[uint64((b * heads_q + head) * p.seqlen_q + pos)] = lse_value
                else:
                    row_id = (b * heads_q + head) * p.seqlen_q + pos
                    part = (row_id * p.num_splits + split) * DV + chunk * 8
                    for c in range(8):
                        p.o_part[uint64(part + c)] = acc[c] * inv
                    if chunk == 0:
                        p.lse_part[uint64(row_id * p.num_splits + split)] = lse_value



    mask_kind = "window" if window else "causal" if causal else "full"
    kind = f"{mask_kind}{'_softcap' if softcap else ''}_{'bf16' if bf16 else 'f16'}"
    kernel = decode_entry(run_decode, window or softcap, sink, batch_idx, leftpad, rotary)
    options = (f"{'_sink' if sink else ''}{'_bidx' if batch_idx else ''}{'_lpad' if leftpad else ''}"
               f"{('', '_rope', '_ropei')[rotary]}")
    dims = f"d{D}v{DV}" if DV != D else f"d{D}"
    kernel.__name__ = f"flash_decode_{dims}_m{BM}_n{BN}{config.tag}_{kind}{options}"
    kernel.launch_bounds = (config.threads, 1)
    return kernel


# Splits one combine warp merges: lane s holds split s's LSE (``launch_decode.MAX_SPLITS`` <= this).
SPLITS_PER_WARP = 32


def make_decode_combine_kernel(config: DecodeConfig, causal: bool, bf16: bool):
    """Merge the splits' float32 partials (``params.DECODE_COMBINE``): one warp per 32 columns
    of an output row (batch, position, query head), lane c column c of them, 4 warps a CTA, grid
    ceil(rows * head_dim / 128); ``causal`` is unused.

    Lane s reads split s's LSE; the warp's max and the weights exp(LSE_s - max) come from
    shuffles, and the column is summed over a fully unrolled loop of ``SPLITS_PER_WARP`` steps
    whose loads do not depend on each other, all in flight at once instead of one L2 round trip
    a split. Step s loads split s's element at a constant offset from the row's first split (one
    address register, 32 loads: about 40 registers) and keeps it only where s is a split of the
    row; past the row's last split it reads the next rows' partials, their LSEs or the scratch's
    tail (``launch_decode.SCRATCH_TAIL_ROWS`` rows of head_dim floats), and drops the value (a
    select, so a NaN there never enters).
    With so few registers a combine CTA fits on an SM beside two d128 decode CTAs: on sm_90 it
    is launched programmatically (``KernelLauncher(..., programmatic=True)``), so its CTAs are
    resident before the decode kernel ends (they may start after its main loop,
    ``ptx.grid_launch_dependents``), and each waits for it (``ptx.grid_dependency_wait``) before
    reading a partial."""
    D = config.value_dim  # O's columns
    GROUPS = D // 32  # warps a row
    BF16 = bf16

    @cuda.jit(device=True, forceinline=True)
    def add_split(s, state):
        """acc[0] += weight_s * O_s[column] where s is one of the row's splits; ``state``: a
        ``CombineRow`` (``first``: the element of the row's first split in this column)."""
        w = cuda.shfl_sync(FULL_MASK, state.weight, s)
        value = state.o_part[uint64(state.first + s * D)]
        state.acc[0] += w * (value if s <= state.last else float32(0.0))

    add_splits = unroll(add_split, SPLITS_PER_WARP)

    def decode_combine(o_part, lse_part, out, lse, o_sb, o_ss, o_sh, batch, seqlen_q, heads_q, num_splits,
                       write_lse):
        tid = cuda.threadIdx.x & 1023
        lane = tid % 32
        warp_id = int64(cuda.blockIdx.x) * 4 + tid // 32
        row_id = warp_id // GROUPS  # (b * heads_q + head) * seqlen_q + pos
        if row_id >= batch * heads_q * seqlen_q:
            return
        col = (warp_id % GROUPS) * 32 + lane
        pos = row_id % seqlen_q
        head = (row_id // seqlen_q) % heads_q
        b = row_id // (seqlen_q * heads_q)
        first = row_id * num_splits
        ptx.grid_dependency_wait()  # on sm_90 this kernel may start before the decode kernel ends
        mine = lse_part[uint64(first + lane)] if lane < num_splits else NEG_INF
        m_max = mine
        for step in (16, 8, 4, 2, 1):
            m_max = max(m_max, cuda.shfl_xor_sync(FULL_MASK, m_max, step))
        weight = ptx.exp2((mine - m_max) * float32(LOG2_E)) if mine != NEG_INF else float32(0.0)
        total = weight
        for step in (16, 8, 4, 2, 1):
            total += cuda.shfl_xor_sync(FULL_MASK, total, step)
        acc = cuda.local.array(1, float32)
        acc[0] = 0.0
        add_splits(CombineRow(acc, o_part, weight, first * D + col, num_splits - 1))
        inv = float32(1.0) / total if total > 0 else float32(0.0)
        packed = pack_16bit(acc[0] * inv, float32(0.0), BF16)
        out[uint64(b * o_sb + pos * o_ss + head * o_sh + col)] = uint16(packed & uint32(0xFFFF))
        if write_lse and col == 0:
            lse[uint64((b * heads_q + head) * seqlen_q + pos)] = (
                m_max + ptx.log2(total) * float32(LN2) if total > 0 else NEG_INF)

    decode_combine.__name__ = f"flash_decode_combine_d{D}_{'bf16' if bf16 else 'f16'}"  # O's head dim
    decode_combine.launch_bounds = (128, 1)
    return decode_combine
