"""Which part of the problem a CTA owns, and which scores it must mask.

A CTA computes one block of query rows of one (batch, head); it reads the KV tiles its rows
can see (all of them, or, causal, those up to the diagonal, or, with a sliding window, those
between its first row's lower edge and its last row's upper edge: ``band_kv_tiles``) and masks
scores only on tiles that cross the end of the keys, the diagonal or an edge of the window. A
persistent CTA (the Hopper kernel) walks a list of such blocks instead (``work_units``,
``unit_tile``, ``make_tile_walk``).
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, int32, int64, uint32, uint64

from .common import NEG_INF

# Where one warp's score fragments sit, for masking: its first query row, the lane, the keys
# that exist, and the causal diagonal (query i sees key j iff j <= i + diag).
ScoreMask = namedtuple("ScoreMask", ["row_first", "lane", "seqlen_k", "diag"])
# A sliding window (FlashAttention's ``window_size``), relative to each query row: query i sees
# key j iff i + first <= j <= i + last and j < seqlen_k, where first = diag - left and last =
# diag + right (diag = seqlen_k - seqlen_q); an unbounded side comes as a left or right so large
# that it bounds nothing (``operations.forward.WINDOW_UNBOUNDED``).
Band = namedtuple("Band", ["seqlen_k", "first", "last"])


@cuda.jit(device=True, forceinline=True)
def query_block(heads_q, group, reverse):
    """(query block, head, batch, kv head) of this CTA, as known non-negative int64 values.

    Grid: x = query blocks; y = heads and z = batch, or, when either exceeds 65535 (the limit
    of y and z), (batch, head) pairs numbered head-fastest, ``hb = y + gridDim.y * z``, which
    this unfolds with two 32-bit divisions (the host's ``forward_grid``); CTAs past the last
    pair then get ``batch >= batch_size`` and must return at once. With ``reverse`` (causal)
    the heaviest query blocks start first, for better tail balance. ``group`` query heads
    share one kv head (GQA).
    """
    m_block = uint32(cuda.blockIdx.x)
    if reverse:
        m_block = uint32(uint32(cuda.gridDim.x) - uint32(1) - m_block)
    # Numba widens uint32 arithmetic to 64 bits: results are cut back to 32 so that the
    # divisions stay 32-bit and every index below is a known non-negative value.
    head = uint32(cuda.blockIdx.y)
    batch = uint32(cuda.blockIdx.z)
    if uint32(cuda.gridDim.y) != uint32(heads_q):  # the folded grid
        hb = uint32(head + uint32(cuda.gridDim.y) * batch)
        head = uint32(hb % uint32(heads_q))
        batch = uint32(hb // uint32(heads_q))
    kv_head = head if group == 1 else uint32(head // uint32(group))
    return int64(m_block), int64(head), int64(batch), int64(kv_head)


# One query block of the persistent kernel's work list: block, head, batch and the kv head.
Tile = namedtuple("Tile", ["m_block", "head", "batch", "kv_head"])
# The sizes of a persistent launch's work: query block m starts at row m * block_m - lead (the
# first block may start before row 0, whose rows are zeros), and there are m_blocks of them;
# ``first`` and ``last``: a sliding window's edges (a Band's; read by window kernels only).
Problem = namedtuple("Problem", ["seqlen_q", "seqlen_k", "heads_q", "group", "batch", "m_blocks", "lead",
                                 "first", "last"])
# Where a query block's sequence sits: its problem (the call's, or for packed sequences the
# sequence's own: lengths, diagonal and window edges), its first query and key rows in the tensors
# (0, or the sequence's offsets), and the batch coordinate of the tensor maps (0 when packed).
Place = namedtuple("Place", ["problem", "start_q", "start_k", "batch"])
# Packed variable-length sequences, as a persistent walk reads them: the int32 offsets (batch + 1,)
# and the window's sides (each >= 0; the sequences' own diagonals place it).
PackedSequences = namedtuple("PackedSequences",
                             ["cu_seqlens_q", "cu_seqlens_k", "window_left", "window_right"])
# One query block of a persistent CTA's walk and where it sits in the rings that every role counts
# alike: its first KV ring use (the KV tiles of the CTA's earlier blocks), its Q ring use (the
# number of earlier blocks), the KV tiles it reads (n_tiles of them from tile kv_first: 0 but with
# a sliding window), and its Place.
TileTurn = namedtuple("TileTurn", ["tile", "kv0", "round_q", "n_tiles", "kv_first", "place"])


@cuda.jit(device=True, forceinline=True)
def work_units(m_blocks, heads_q, batch, causal):
    """Work units of a persistent launch. A unit is one query block, or with causal masking
    a pair of query blocks of one head, block m_blocks-1-i (heavy) and block i (light): every
    pair reads about the same number of KV tiles, so CTAs that take units in turn stay in
    step, read the K and V of only a few heads at a time (L2), and no CTA is left alone with
    the heavy end of a triangle."""
    per_head = (m_blocks + 1) // 2 if causal else m_blocks
    return per_head * heads_q * batch


@cuda.jit(device=True, forceinline=True)
def unit_tile(u, h, m_blocks, heads_q, group, causal, grid):
    """Query block h (0, or 1 with causal masking) of work unit u, and whether it exists
    (the middle unit of an odd block count has one block). Units of one (batch, head) are
    consecutive, so CTAs running together share that head's K and V in L2.

    ``grid`` CTAs take units c, c + grid, ...: where grid is a multiple of the units per head,
    CTA c would always get position c % per_head of a head, and cheaper blocks (a ragged last
    block whose warpgroups pass over it) would all fall to the same CTAs, which then run ahead
    and idle at the end. So the positions of a head are rotated by its round (the heads that run
    together share a rotation): every CTA takes every position in turn."""
    m_blocks = uint32(m_blocks)
    per_head = (m_blocks + uint32(1)) // uint32(2) if causal else m_blocks
    u = uint32(u)
    pair = u // per_head
    heads_per_round = max(uint32(grid) // per_head, uint32(1))
    i = (u % per_head + pair // heads_per_round) % per_head
    m_block = i
    present = True
    if causal:
        heavy = m_blocks - uint32(1) - i
        m_block = heavy if h == 0 else i
        present = h == 0 or i != heavy
    head = pair % uint32(heads_q)
    return Tile(m_block, head, pair // uint32(heads_q), head // uint32(group)), present


@cuda.jit(device=True, forceinline=True)
def key_block_of(cta, key_blocks, pairs, tail_pairs):
    """(key block, pair) of the backward's CTA number ``cta`` in launch order, for ``pairs``
    (batch, KV head) pairs of ``key_blocks`` key blocks each (pair = batch * heads_kv + kv_head).

    The first ``pairs - tail_pairs`` pairs launch one after the other, each pair's key blocks in
    order 0, 1, ...: the CTAs that run together belong to a few heads and share their Q and dO in
    L2. The last ``tail_pairs`` pairs launch interleaved, key block by key block (every tail
    pair's block 0, then every block 1, ...). With causal masking key block n walks fewer query
    blocks than block n - 1, so the launch ends on its shortest CTAs instead of starting a long
    one when the other SMs are about to run out of work (longest first, for the last waves).

    Invariants (``tests/test_backward_schedule_cpu.py``): a bijection of ``0 .. key_blocks *
    pairs - 1`` onto (block, pair); each pair's blocks launch in increasing order (deterministic
    mode's turns: a CTA waits only for CTAs launched before it); ``tail_pairs == 0`` is the plain
    (block, pair) order."""
    cta, key_blocks, pairs, tail_pairs = uint32(cta), uint32(key_blocks), uint32(pairs), uint32(tail_pairs)
    head_ctas = (pairs - tail_pairs) * key_blocks  # the grid has at most 2^31 - 1 CTAs: 32 bits
    if cta < head_ctas:
        return int64(cta % key_blocks), int64(cta // key_blocks)
    t = cta - head_ctas
    return int64(t // tail_pairs), int64(pairs - tail_pairs + t % tail_pairs)


@cuda.jit(device=True, forceinline=True)
def key_block_of_narrow(cta, key_blocks, pairs, tail_pairs):
    """``key_block_of``, its tail's division in 32 bits: Numba widens uint32 arithmetic to 64
    bits, so ``key_block_of``'s t // tail_pairs is a div.u64 (a called subroutine in SASS). The
    mma.sync backward's causal kernels at d96 take this one (ptxas then keeps the launch
    indices in uniform registers: d96 v4 causal on sm_90a 241 registers instead of 252); the
    others keep ``key_block_of``, with which ptxas gave them as many registers or fewer (d32 v4
    causal softcap on sm_90a: 168 against 178, d96 v4 window: 242 against 244), as does the
    Hopper backward."""
    cta, key_blocks, pairs, tail_pairs = uint32(cta), uint32(key_blocks), uint32(pairs), uint32(tail_pairs)
    head_ctas = (pairs - tail_pairs) * key_blocks
    if cta < head_ctas:
        return int64(cta % key_blocks), int64(cta // key_blocks)
    t = uint32(cta - head_ctas)
    return int64(uint32(t // tail_pairs)), int64(uint32(pairs - tail_pairs + t % tail_pairs))


@cuda.jit(device=True, forceinline=True)
def visible_kv_tiles(m0, block_m, block_n, seqlen_k, diag, causal):
    """KV tiles a query block starting at row ``m0`` reads; causal stops after the tile that
    holds the last row's diagonal (query i sees keys j <= i + diag)."""
    n_tiles = (seqlen_k + block_n - 1) // block_n
    if causal:
        n_tiles = min(n_tiles, (m0 + block_m + diag + block_n - 1) // block_n)
    return n_tiles


@cuda.jit(device=True, forceinline=True)
def mask_scores(s, n_tiles, col0, row0, lane, seqlen_k, diag, causal):
    """Set to -inf the scores of keys >= seqlen_k and, if ``causal``, of keys after the
    diagonal (query i sees key j iff j <= i + diag). ``col0``/``row0``: first key/query.

    Each fragment row gets one 32-bit limit, the number of this lane's leading columns it
    may see, so every score costs one compare with a constant and one select."""
    g = lane // 4
    t = lane % 4
    for half in range(2):
        sees = seqlen_k  # keys this row sees: [0, sees)
        if causal:
            sees = min(sees, row0 + g + 8 * half + diag + 1)
        # this lane's columns col0 + 2t + c with c < limit are seen; clamped to 32 bits
        limit = int32(max(min(sees - (col0 + 2 * t), 1 << 30), -1))
        for j in range(n_tiles):
            for e in range(2):
                if j * 8 + e >= limit:
                    s[j, 2 * half + e] = NEG_INF


@cuda.jit(device=True, forceinline=True)
def band_kv_tiles(m0, rows, block_n, band):
    """(first, end): the KV tiles ``first .. end - 1`` that query rows ``m0 .. m0 + rows - 1``
    read under the sliding window ``band`` (a Band), so the loop costs the window, not the keys.

    Invariants (``tests/test_window_softcap_cpu.py``): every key that some row of the block sees
    lies in a tile of the range; the first and the last tile of the range each hold a key that
    some row sees (no tile is read for nothing at either end); a block whose rows see no key gets
    an empty range (first == end), and then its rows give 0 and LSE -inf. ``rows`` >= 1."""
    lo = max(m0 + band.first, 0)  # the first row's first key (keys below 0 do not exist)
    hi = min(m0 + rows + band.last, band.seqlen_k)  # one past the last row's last key
    first = lo // block_n
    end = (hi + block_n - 1) // block_n if hi > lo else first
    return first, end


@cuda.jit(device=True, forceinline=True)
def band_query_blocks(n0, keys, block_m, seqlen_q, band):
    """(first, end): the query blocks ``first .. end - 1`` (of ``block_m`` rows, block m from row
    m * block_m) whose rows see one of the keys ``n0 .. n0 + keys - 1`` under the sliding window
    ``band`` (a Band): the backward's walk for one key block, so that it costs the window.

    Query i sees key j iff j - last <= i <= j - first (and i < seqlen_q, j < seqlen_k), so the
    rows that see a key of the block are ``n0 - last .. n0 + keys - 1 - first``, clipped to the
    rows that exist: one range, since each key's rows are a range that moves by one a key.

    Invariants (``tests/test_backward_window_cpu.py``): every query row that sees a key of the
    block lies in a block of the range; the first and the last block of the range each hold such
    a row; a key block no row sees gets an empty range (first == end: its dK and dV are 0); and
    it is the inverse of ``band_kv_tiles``: query block m is in key block n's range iff key tile
    n is in query block m's range (each with its real extent, ``keys`` and ``rows`` >= 1), so the
    key blocks that visit a query block are the consecutive ones from its ``band_kv_tiles`` first
    (deterministic mode's turns)."""
    lo = max(n0 - band.last, 0)  # the first row that sees the block's first key
    hi = min(n0 + keys - band.first, seqlen_q)  # one past the last row that sees its last key
    first = lo // block_m
    end = (hi + block_m - 1) // block_m if hi > lo else first
    return first, end


@cuda.jit(device=True, forceinline=True)
def band_needs_mask(col0, block_n, row_first, rows, band):
    """Whether the tile of ``block_n`` keys from ``col0`` holds a key that one of the rows
    ``row_first .. row_first + rows - 1`` does not see (the tile crosses the end of the keys,
    the window's upper edge for the first row, or its lower edge for the last row); where it
    does not, every score of the tile is visible and ``mask_band`` may be skipped."""
    return (col0 + block_n > band.seqlen_k or col0 + block_n - 1 > row_first + band.last
            or col0 < row_first + rows - 1 + band.first)


@cuda.jit(device=True, forceinline=True)
def mask_band(s, n_tiles, col0, row0, lane, band):
    """Set to -inf the scores of one 16-row m-tile (first query ``row0``, keys from ``col0``)
    that the sliding window ``band`` hides: keys >= seqlen_k, after the row's upper edge
    (j > i + last) or before its lower edge (j < i + first).

    ``mask_scores``' row limits with a lower limit beside the upper one: each fragment row gets
    two 32-bit limits on this lane's column index, so every score costs two compares with a
    constant and one select."""
    g = lane // 4
    t = lane % 4
    for half in range(2):
        row = row0 + g + 8 * half
        col = col0 + 2 * t  # this lane's columns col + 8j + c, c in {0, 1}
        # the column indices 8j + c this row sees are [low, high); clamped to 32 bits
        high = int32(max(min(min(band.seqlen_k, row + band.last + 1) - col, 1 << 30), -1))
        low = int32(max(min(row + band.first - col, 1 << 30), -1))
        for j in range(n_tiles):
            for e in range(2):
                if j * 8 + e >= high or j * 8 + e < low:
                    s[j, 2 * half + e] = NEG_INF


@cuda.jit(device=True, forceinline=True)
def mask_if_needed(s, n_tiles, col0, block_n, at, causal):
    """``mask_scores`` for one warp's tile of ``block_n`` keys from ``col0`` (``at``: ScoreMask),
    only where the tile crosses the end of the keys or (causal) the diagonal."""
    if col0 + block_n > at.seqlen_k or (causal and col0 + block_n - 1 > at.row_first + at.diag):
        mask_scores(s, n_tiles, col0, at.row_first, at.lane, at.seqlen_k, at.diag, causal)


@cuda.jit(device=True, forceinline=True)
def block_first_row(tile, problem, block_m):
    """The first row of ``tile``'s query block (negative for the first block when it leads row 0)."""
    return int32(tile.m_block * block_m) - problem.lead


@cuda.jit(device=True, forceinline=True)
def block_kv_tiles(tile, problem, block_m, block_n, causal):
    """KV tiles ``tile``'s query block reads (0 when causal hides every key from it)."""
    diag = problem.seqlen_k - problem.seqlen_q
    n = visible_kv_tiles(block_first_row(tile, problem, block_m), block_m, block_n, problem.seqlen_k, diag,
                         causal)
    return max(n, 0)


@cuda.jit(device=True, forceinline=True)
def block_visible_tiles(tile, problem, block_m, block_n, causal):
    """(first, count): the KV tiles ``tile``'s query block reads, from tile 0 (``block_kv_tiles``)."""
    return int32(0), block_kv_tiles(tile, problem, block_m, block_n, causal)


@cuda.jit(device=True, forceinline=True)
def block_band_tiles(tile, problem, block_m, block_n, causal):
    """(first, count): the KV tiles ``tile``'s query block reads under the sliding window of
    ``problem`` (``band_kv_tiles`` over the block's rows that exist; ``causal`` is unused: a
    window kernel's right edge is its causal masking)."""
    m0 = block_first_row(tile, problem, block_m)
    rows = min(block_m, problem.seqlen_q - m0)  # >= 1: blocks start below seqlen_q
    first, end = band_kv_tiles(m0, rows, block_n, Band(problem.seqlen_k, problem.first, problem.last))
    return int32(first), int32(end - first)


@cuda.jit(device=True, forceinline=True)
def sequence_place(tile, problem, seqs):
    """The Place of ``tile``'s packed sequence (``tile.batch``: its index): its offsets and lengths
    from ``seqs`` (a PackedSequences; four int32 loads), its own diagonal and window edges."""
    b = tile.batch
    start_q = int32(seqs.cu_seqlens_q[b])
    start_k = int32(seqs.cu_seqlens_k[b])
    seqlen_q = int32(seqs.cu_seqlens_q[b + uint32(1)]) - start_q
    seqlen_k = int32(seqs.cu_seqlens_k[b + uint32(1)]) - start_k
    diag = int64(seqlen_k - seqlen_q)
    own = Problem(seqlen_q, seqlen_k, problem.heads_q, problem.group, problem.batch, problem.m_blocks,
                  int32(0), diag - seqs.window_left, diag + seqs.window_right)
    return Place(own, start_q, start_k, int32(0))


@cuda.jit(device=True, forceinline=True)
def call_place(tile, problem, seqs):
    """The Place of a block of a dense call (``seqs`` unused): the call's problem, its batch."""
    return Place(problem, int32(0), int32(0), int32(tile.batch))


def make_tile_walk(on_tile, block_m: int, block_n: int, causal: bool, window: bool = False,
                   varlen: bool = False):
    """A device function ``walk(ctx, problem, seqs)``: this CTA of a persistent grid takes work units
    blockIdx.x, + gridDim.x, ... (``work_units``) and calls ``kv = on_tile(ctx, turn)`` for each
    query block of each, in order, with its ``TileTurn``; ``ctx`` is whatever ``on_tile`` needs.
    The producer and the consumers of a CTA walk the same list, so they count the Q ring alike;
    ``on_tile`` returns the KV ring count after the block, ``turn.kv0 + turn.n_tiles`` (the
    producer counts its loads one by one, a consumer adds the block's tiles). ``window``: a
    sliding-window kernel (built non-causal: one query block a unit, each costing about the
    window), whose blocks read the tiles of ``block_band_tiles``. ``varlen``: packed sequences
    (``seqs``, a PackedSequences; unused otherwise): ``problem`` counts ceil(max_seqlen_q /
    block_m) blocks of every sequence, and the blocks past a sequence's own end (all of an empty
    one) are passed over before any role touches a ring, so the walk visits only real blocks."""
    tiles_per_unit = 2 if causal else 1  # query blocks per work unit

    block_tiles = block_band_tiles if window else block_visible_tiles
    place_of = sequence_place if varlen else call_place

    @cuda.jit(device=True, forceinline=True)
    def walk(ctx, problem, seqs):
        # Numba widens uint32 sums to 64 bits: the counts are uint64 from the start, so that a
        # TileTurn has one type (the rings cut them back to 32 bits).
        kv = uint64(0)  # KV tiles of the blocks before: the KV ring position
        round_q = uint64(0)  # blocks before: the Q ring position
        m_blocks, heads_q = problem.m_blocks, problem.heads_q
        for u in range(cuda.blockIdx.x, work_units(m_blocks, heads_q, problem.batch, causal), cuda.gridDim.x):
            for h in range(tiles_per_unit):
                tile, present = unit_tile(u, h, m_blocks, heads_q, problem.group, causal, cuda.gridDim.x)
                if not present:
                    continue
                place = place_of(tile, problem, seqs)
                if varlen and int32(tile.m_block * uint32(block_m)) >= place.problem.seqlen_q:
                    continue  # past its sequence's end (varlen: a compile-time constant)
                kv_first, n_tiles = block_tiles(tile, place.problem, block_m, block_n, causal)
                kv = on_tile(ctx, TileTurn(tile, kv, round_q, n_tiles, kv_first, place))
                round_q += uint32(1)

    return walk


@cuda.jit(device=True, forceinline=True)
def mask_transposed(s, n_tiles, key0, col0, lane, seqlen_k, diag, causal):
    """Set to -inf the scores of a transposed fragment (rows: keys ``key0`` + g, + 8; columns:
    queries ``col0`` + 8j + 2t + e) whose key is past the last or, causal, after the diagonal
    (query i sees key j iff j <= i + diag). One limit a row: the lane's leading columns that
    are hidden."""
    g = lane // 4
    t = lane % 4
    for half in range(2):
        key = key0 + g + 8 * half
        first = key - diag if causal else int64(-(1 << 30))  # the first query that sees the key
        if key >= seqlen_k:
            first = int64(1 << 30)
        limit = int32(max(min(first - (col0 + 2 * t), 1 << 30), -1))
        for j in range(n_tiles):
            for e in range(2):
                if j * 8 + e < limit:
                    s[j, 2 * half + e] = NEG_INF


@cuda.jit(device=True, forceinline=True)
def mask_band_transposed(s, n_tiles, key0, col0, lane, band):
    """``mask_transposed`` under a sliding window ``band`` (a ``blocks.Band``): set to -inf the
    scores of a transposed fragment (rows: keys ``key0`` + g, + 8; columns: queries ``col0`` + 8j
    + 2t + e) whose key is past the last or outside the query's window (query i sees key j iff
    i + first <= j <= i + last, i.e. j - last <= i <= j - first). Two 32-bit limits a row on the
    lane's column index: the queries that see the row's key are columns [low, high)."""
    g = lane // 4
    t = lane % 4
    for half in range(2):
        key = key0 + g + 8 * half
        col = col0 + 2 * t
        low = int32(max(min(key - band.last - col, 1 << 30), -1))
        high = int32(max(min(key - band.first + 1 - col, 1 << 30), -1))
        if key >= band.seqlen_k:
            high = int32(-1)
        for j in range(n_tiles):
            for e in range(2):
                if j * 8 + e < low or j * 8 + e >= high:
                    s[j, 2 * half + e] = NEG_INF
