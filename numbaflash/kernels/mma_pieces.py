"""The pieces of the mma.sync kernels (``forward_mma``, ``decode_mma``): S = Q Kᵀ and O += P V on
m16n8k16 fragments, the online softmax over them, and the masker of their score tiles.

Each ``make_*`` factory is one room with one job; it returns its named steps (device functions
specialised on an ``MmaShape``). A warp owns ``m_tiles`` 16-row m-tiles of the Q tile (rows from
the address it passes) and ``keys`` keys of the K and V tiles at the addresses it passes: key
slice ``key_slice`` (rows from ``key_slice * keys``); the forward's warps take every key of a
tile (slice 0), decode's warp w slice w. Fragments follow
``softmax``'s layout: ``acc_s[mt, j, e]`` is element e of S n-tile j of m-tile mt (fp32),
``acc_o[mt, j, e]`` the same for O, ``q_frag[mt, kt]`` and ``p_frag[mt, kt]`` 16-bit A fragments
(uint32[4]), ``b_frag[buf]`` a uint32[4] B fragment pair (two buffers with ``double_buffer``).
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32

from .. import ptx
from .blocks import band_needs_mask, mask_band, mask_scores
from .common import FULL_MASK, NEG_INF, THRESHOLD, unroll
from .smem import block_offset
from .softmax import (
    P_SCALE_E4M3,
    cap_scores,
    exponent_offsets,
    exponentiate,
    exponentiate_e4m3,
    exponentiate_slice,
    max_grew,
    pack_p_e4m3,
    pack_p_fragments,
    pack_p_slice,
    rescale_rows,
    scaled_row_maxes,
    start_at_sink,
)

# The sizes the pieces are built for: head_dim (Q's and K's); rows of the Q tile and of the K / V
# tiles (the tiles' swizzle column blocks are that many rows apart); the keys of a K / V tile a warp
# takes; the warp's m-tiles; the bytes of a swizzle block row (``smem``); V's and O's head dim
# (``value_dim``: 0 for head_dim).
MmaShape = namedtuple("MmaShape", ["head_dim", "q_rows", "kv_rows", "keys", "m_tiles", "row_bytes",
                                   "value_dim"], defaults=(0,))
# S = Q Kᵀ (``make_qk_steps``): a Q k-slice's ldmatrix, and the whole product.
QkSteps = namedtuple("QkSteps", ["load_q_slice", "qk_scores"])
# One k-slice of S = Q Kᵀ (``make_qk_steps``): qk_scores' arguments.
QkSlice = namedtuple("QkSlice", ["acc_s", "q_frag", "q_tile", "a_offsets", "k_tile", "k_offsets", "b_frag",
                                 "key_slice"])
# O += P V (``make_pv_steps``): a V pair's ldmatrix, one 16-key slice, and the whole product.
PvSteps = namedtuple("PvSteps", ["v_load", "pv_slice", "pv_accumulate"])
# The online softmax (``make_online_softmax``).
SoftmaxSteps = namedtuple("SoftmaxSteps", ["start_rows", "cap", "refresh_row_maxes", "exponentiate_tile",
                                           "online_softmax", "softmax_into_pv"])
# The masker (``make_masker``): a forward tile's rows, decode's packed rows.
Masker = namedtuple("Masker", ["mask_tile", "mask_rows"])
# What the interleaved softmax + PV slices share (``slice_into_pv``): S (exponentiated in place),
# O, P fragments, the exponent offsets and partial row sums of every m-tile, the softmax scale,
# and V's tile, ldmatrix offsets and fragment buffer.
PvSlices = namedtuple("PvSlices", ["acc_s", "acc_o", "p_frag", "m_use", "row_sum", "scale_log2", "v_tile",
                                   "v_offsets", "b_frag"])


def make_qk_steps(shape: MmaShape, q_resident: bool, double_buffer: bool, bf16: bool, fp8: bool = False,
                  accumulate: bool = False) -> QkSteps:
    """S = Q Kᵀ for a warp's m-tiles against its ``shape.keys`` keys. ``q_resident``: Q's
    fragments ``q_frag[mt, kt]`` stay in registers (loaded once by the kernel), else each
    k-slice is loaded from the Q tile into ``q_frag[mt, buf]``. ``double_buffer``: the next K
    pair (and Q slice) is loaded before the current mma.sync, into the other buffer.

    ``fp8``: e4m3 operands, m16n8k32. Its A and B fragments are the m16n8k16 ones with each byte
    pair read as one 16-bit element, so the tiles are described as 16-bit tiles of half the
    columns (``shape.head_dim`` = bytes / 2) and loaded alike; only the mma differs.
    ``accumulate``: add to the accumulator instead of zeroing it first (the e4m3 forward's
    O += P V is this product, P's fragments resident, V transposed as the B tile)."""
    MT = shape.m_tiles
    RB = shape.row_bytes
    BM = shape.q_rows
    BN = shape.kv_rows
    D_K_TILES = shape.head_dim // 16  # k-tiles of the QKᵀ product
    KEYS = shape.keys
    S_N_TILES = KEYS // 8  # n-tiles of the S accumulator
    S_PAIRS = S_N_TILES // 2  # K ldmatrix.x4 loads per k-slice (two n-tiles each)
    S_STEPS = D_K_TILES * S_PAIRS  # K loads of one S product (even: D_K_TILES is)
    Q_RESIDENT = q_resident
    DOUBLE_BUFFER = double_buffer
    # Unrolled in Python above 16 k-slices (head_dim 512): NVVM leaves a 32-slice loop rolled, and
    # the ldmatrix offsets it then indexes at run time go to local memory.
    UNROLL_SLICES = D_K_TILES > 16
    ZERO = not accumulate
    mma = ptx.mma_m16n8k32_e4m3 if fp8 else ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    @cuda.jit(device=True, forceinline=True)
    def load_q_slice(q_frag, buf, q_tile, a_offsets, kt):
        """ldmatrix k-slice ``kt`` of the warp's Q rows (every m-tile) into ``q_frag[:, buf]``."""
        for mt in range(MT):
            ptx.ldmatrix_x4(q_frag[mt, buf], q_tile + block_offset(a_offsets, kt, BM, RB) + mt * 16 * RB)

    @cuda.jit(device=True, forceinline=True)
    def k_load(b_frag, buf, k_tile, k_offsets, i):
        """ldmatrix K fragment pair ``i`` (k-slice ``i // S_PAIRS``, n-tiles 2j2, 2j2+1 with
        ``j2 = i % S_PAIRS``) of the first key slice into ``b_frag[buf]``."""
        k_at = k_tile + block_offset(k_offsets, i // S_PAIRS, BN, RB) + (i % S_PAIRS) * 16 * RB
        ptx.ldmatrix_x4(b_frag[buf], k_at)

    @cuda.jit(device=True, forceinline=True)
    def k_mma(acc_s, q_frag, qt, b_frag, buf, i):
        """The MT x 2 mma.sync of K fragment pair ``i`` (in ``b_frag[buf]``) with Q slice ``qt``."""
        j2 = i % S_PAIRS
        for mt in range(MT):
            mma(acc_s[mt, 2 * j2], q_frag[mt, qt], b_frag[buf, 0:2])
            mma(acc_s[mt, 2 * j2 + 1], q_frag[mt, qt], b_frag[buf, 2:4])

    @cuda.jit(device=True, forceinline=True)
    def qk_step(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag, buf, i):
        """Double-buffered S step ``i``: at a k-slice's first step, the next slice's Q (not
        resident); then the next K pair's ldmatrix into the other buffer; then this pair's mma."""
        kt = i // S_PAIRS
        qt = kt if Q_RESIDENT else kt % 2
        if not Q_RESIDENT and i % S_PAIRS == 0 and kt + 1 < D_K_TILES:
            load_q_slice(q_frag, (kt + 1) % 2, q_tile, a_offsets, kt + 1)
        if i + 1 < S_STEPS:
            k_load(b_frag, 1 - buf, k_tile, k_offsets, i + 1)
        k_mma(acc_s, q_frag, qt, b_frag, buf, i)

    @cuda.jit(device=True, forceinline=True)
    def qk_scores(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag, key_slice):
        """S = Q Kᵀ for the warp's m-tiles (Q rows at ``q_tile``) against key slice
        ``key_slice`` of the K tile at ``k_tile`` (its ``keys`` rows from ``key_slice * keys``;
        0 with DOUBLE_BUFFER): K fragments by ldmatrix, two n-tiles per load. With DOUBLE_BUFFER
        the steps go in pairs so that every buffer index is a constant before unrolling."""
        if ZERO:
            for mt in range(MT):
                for j in range(S_N_TILES):
                    for e in range(4):
                        acc_s[mt, j, e] = 0.0
        if not Q_RESIDENT:
            load_q_slice(q_frag, 0, q_tile, a_offsets, 0)
        if DOUBLE_BUFFER:
            k_load(b_frag, 0, k_tile, k_offsets, 0)
            for kt in range(D_K_TILES):  # nested loops of small trip counts unroll fully
                for p in range(S_PAIRS // 2):
                    i = kt * S_PAIRS + 2 * p
                    qk_step(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag, 0, i)
                    qk_step(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag, 1, i + 1)
            return
        if UNROLL_SLICES:  # head dims above 256: NVVM leaves a loop this long rolled
            qk_slices(QkSlice(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag, key_slice))
            return
        for kt in range(D_K_TILES):
            qk_slice(kt, QkSlice(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag, key_slice))

    @cuda.jit(device=True, forceinline=True)
    def qk_slice(kt, state):
        """k-slice ``kt`` of S = Q Kᵀ (not double-buffered): Q's slice (not resident), then the
        K pairs' ldmatrix and mma.sync. ``state``: a QkSlice, qk_scores' arguments."""
        qt = kt
        if not Q_RESIDENT:
            qt = 0
            if kt > 0:
                load_q_slice(state.q_frag, 0, state.q_tile, state.a_offsets, kt)
        for j2 in range(S_PAIRS):
            k_at = (state.k_tile + block_offset(state.k_offsets, kt, BN, RB)
                    + (state.key_slice * KEYS + j2 * 16) * RB)
            ptx.ldmatrix_x4(state.b_frag[0], k_at)
            for mt in range(MT):
                mma(state.acc_s[mt, 2 * j2], state.q_frag[mt, qt], state.b_frag[0, 0:2])
                mma(state.acc_s[mt, 2 * j2 + 1], state.q_frag[mt, qt], state.b_frag[0, 2:4])

    qk_slices = unroll(qk_slice, D_K_TILES)

    return QkSteps(load_q_slice, qk_scores)


def make_pv_steps(shape: MmaShape, double_buffer: bool, bf16: bool) -> PvSteps:
    """O += P V for a warp's m-tiles over its ``shape.keys`` keys of a V tile: P from registers
    (``p_frag``), V fragments by transposing ldmatrix. ``double_buffer``: each step loads the
    next V pair before its mma.sync (``v_load(.., 0, .., 0)`` starts the chain)."""
    MT = shape.m_tiles
    RB = shape.row_bytes
    BN = shape.kv_rows
    KEYS = shape.keys
    D_N_TILES = (shape.value_dim or shape.head_dim) // 8  # n-tiles of the O accumulator
    P_K_TILES = KEYS // 16  # k-tiles of the PV product
    O_PAIRS = D_N_TILES // 2  # V ldmatrix.x4 loads per k-slice
    O_STEPS = P_K_TILES * O_PAIRS  # V loads of one PV product (even: O_PAIRS is)
    DOUBLE_BUFFER = double_buffer
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    @cuda.jit(device=True, forceinline=True)
    def v_load(b_frag, buf, v_tile, v_offsets, i):
        """Transposing ldmatrix of V pair ``i``: rows of k-slice ``i // O_PAIRS``, O columns
        of pair ``i % O_PAIRS`` (16 columns), into ``b_frag[buf]``."""
        v_at = v_tile + block_offset(v_offsets, i % O_PAIRS, BN, RB) + (i // O_PAIRS) * 16 * RB
        ptx.ldmatrix_x4_trans(b_frag[buf], v_at)

    @cuda.jit(device=True, forceinline=True)
    def v_mma(acc_o, p_frag, b_frag, buf, i):
        kt = i // O_PAIRS
        j2 = i % O_PAIRS
        for mt in range(MT):
            mma(acc_o[mt, 2 * j2], p_frag[mt, kt], b_frag[buf, 0:2])
            mma(acc_o[mt, 2 * j2 + 1], p_frag[mt, kt], b_frag[buf, 2:4])

    @cuda.jit(device=True, forceinline=True)
    def pv_step(acc_o, p_frag, v_tile, v_offsets, b_frag, buf, i):
        if i + 1 < O_STEPS:
            v_load(b_frag, 1 - buf, v_tile, v_offsets, i + 1)
        v_mma(acc_o, p_frag, b_frag, buf, i)

    @cuda.jit(device=True, forceinline=True)
    def pv_slice(acc_o, p_frag, v_tile, v_offsets, b_frag, kt, key_slice):
        """O += P V over the 16 keys of k-slice ``kt`` of key slice ``key_slice`` (``keys`` rows
        of the V tile from ``key_slice * keys``; 0 with DOUBLE_BUFFER). With DOUBLE_BUFFER each step
        loads the next V pair (the first of the next slice at the end) before its mma.sync."""
        if DOUBLE_BUFFER:
            for p in range(O_PAIRS // 2):
                i = kt * O_PAIRS + 2 * p
                pv_step(acc_o, p_frag, v_tile, v_offsets, b_frag, 0, i)
                pv_step(acc_o, p_frag, v_tile, v_offsets, b_frag, 1, i + 1)
            return
        for j2 in range(O_PAIRS):
            v_at = v_tile + block_offset(v_offsets, j2, BN, RB) + (key_slice * KEYS + kt * 16) * RB
            ptx.ldmatrix_x4_trans(b_frag[0], v_at)
            for mt in range(MT):
                mma(acc_o[mt, 2 * j2], p_frag[mt, kt], b_frag[0, 0:2])
                mma(acc_o[mt, 2 * j2 + 1], p_frag[mt, kt], b_frag[0, 2:4])

    @cuda.jit(device=True, forceinline=True)
    def pv_accumulate(acc_o, p_frag, v_tile, v_offsets, b_frag, key_slice):
        """O += P V (key slice ``key_slice`` of the V tile at ``v_tile``), k-slice by k-slice."""
        if DOUBLE_BUFFER:
            v_load(b_frag, 0, v_tile, v_offsets, 0)
        for kt in range(P_K_TILES):
            pv_slice(acc_o, p_frag, v_tile, v_offsets, b_frag, kt, key_slice)

    return PvSteps(v_load, pv_slice, pv_accumulate)


def make_online_softmax(shape: MmaShape, bf16: bool, pv: PvSteps | None, double_buffer: bool,
                        sink: bool = False, fp8: bool = False) -> SoftmaxSteps:
    """The online softmax of a warp's S fragments in the exp2 domain (``m_run``, ``l_run``: the
    running row maxes, scaled, and this lane's partial row sums, (m_tiles, 2) float32; ``mx``:
    scratch of that shape). ``start_rows``: the state before the first tile (max -inf, sum 0; with
    ``sink``, the learnable sink's term: ``softmax.start_at_sink``, the one place a sink build's
    arithmetic differs). ``cap``: the softcap's tanh over every m-tile. ``online_softmax``:
    S -> P (16-bit fragments), row maxes refreshed lazily (``refresh_row_maxes``: O rescaled only
    when a row max of the warp grew by more than ``common.THRESHOLD``), then ``exponentiate_tile``
    (P and the partial row sums). ``softmax_into_pv``: the same, each 16-key
    slice's exponentials followed by its PV mma.sync (``pv``), so that a warp's MUFU work
    overlaps its tensor-core work.

    ``fp8``: P for an e4m3 PV product (``softmax.exponentiate_e4m3``: P times ``P_SCALE_E4M3``, which
    the row sums carry too, the sink's term included; ``softmax.pack_p_e4m3``: 32 keys a k-step in
    ``fp8_layout.KEY_ORDER``); no ``softmax_into_pv`` (``pv`` None)."""
    MT = shape.m_tiles
    D_N_TILES = (shape.value_dim or shape.head_dim) // 8  # of O
    S_N_TILES = shape.keys // 8
    P_K_TILES = shape.keys // 16
    DOUBLE_BUFFER = double_buffer
    BF16 = bf16
    SINK = sink
    FP8 = fp8
    P_STEPS = shape.keys // 32  # e4m3: k-steps of the PV product
    v_load, pv_slice = (pv.v_load, pv.pv_slice) if pv is not None else (None, None)

    @cuda.jit(device=True, forceinline=True)
    def start_rows(m_run, l_run, logit):
        """Every m-tile's running maxes and sums before the first tile; ``logit``: the sink's
        (``softmax.sink_logit``), read by sink builds only."""
        for mt in range(MT):
            if SINK:
                start_at_sink(m_run[mt], l_run[mt], logit)
                if FP8:  # the sink's term carries P's scale, as every other term of the sums
                    for r in range(2):
                        l_run[mt, r] *= float32(P_SCALE_E4M3)
            else:
                for r in range(2):
                    m_run[mt, r] = NEG_INF
                    l_run[mt, r] = 0.0

    @cuda.jit(device=True, forceinline=True)
    def cap(acc_s, cap_scale):
        """Softcap every m-tile's raw scores (``softmax.cap_scores``), before the masks."""
        for mt in range(MT):
            cap_scores(acc_s[mt], S_N_TILES, cap_scale)

    @cuda.jit(device=True, forceinline=True)
    def refresh_row_maxes(acc_s, acc_o, m_run, l_run, mx, scale_log2):
        """This tile's row maxes; the running ones are refreshed lazily: O is rescaled only
        when some row of the warp grew by more than 2^THRESHOLD."""
        grow = False
        for mt in range(MT):
            scaled_row_maxes(acc_s[mt], S_N_TILES, mx[mt], scale_log2)
            grow = grow or max_grew(mx[mt], m_run[mt], THRESHOLD)
        if cuda.any_sync(FULL_MASK, grow):
            for mt in range(MT):
                rescale_rows(acc_o[mt], D_N_TILES, m_run[mt], l_run[mt], mx[mt])

    @cuda.jit(device=True, forceinline=True)
    def slice_into_pv(kt, state):
        """Exponentials of k-slice ``kt`` (16 keys, every m-tile), then its PV mma.sync
        (``state``: a PvSlices)."""
        acc_s, p_frag = state.acc_s, state.p_frag
        for mt in range(MT):
            exponentiate_slice(acc_s[mt], kt, state.m_use[mt], state.row_sum[mt], state.scale_log2)
            pack_p_slice(p_frag[mt], acc_s[mt], kt, BF16)
        pv_slice(state.acc_o, p_frag, state.v_tile, state.v_offsets, state.b_frag, kt, 0)

    slices_into_pv = unroll(slice_into_pv, P_K_TILES)

    @cuda.jit(device=True, forceinline=True)
    def softmax_into_pv(acc_s, acc_o, p_frag, m_run, l_run, mx, scale_log2, v_tile, v_offsets, b_frag):
        """The online softmax and O += P V as one stretch of code with no barrier: the
        exponentials of each 16-key slice, then that slice's PV mma.sync, so that a warp's
        MUFU work on slice kt + 1 can overlap its tensor-core work on slice kt."""
        if DOUBLE_BUFFER:
            v_load(b_frag, 0, v_tile, v_offsets, 0)  # V has landed: needs no row max
        refresh_row_maxes(acc_s, acc_o, m_run, l_run, mx, scale_log2)
        m_use = cuda.local.array((MT, 2), float32)
        row_sum = cuda.local.array((MT, 2), float32)
        for mt in range(MT):
            exponent_offsets(m_use[mt], m_run[mt])
            for r in range(2):
                row_sum[mt, r] = 0.0
        slices_into_pv(PvSlices(acc_s, acc_o, p_frag, m_use, row_sum, scale_log2, v_tile, v_offsets, b_frag))
        for mt in range(MT):
            for r in range(2):
                l_run[mt, r] += row_sum[mt, r]

    @cuda.jit(device=True, forceinline=True)
    def exponentiate_tile(acc_s, p_frag, m_run, l_run, scale_log2):
        """S -> P (16-bit fragments) in the exp2 domain against the running row maxes, and
        this lane's partial row sums."""
        for mt in range(MT):
            if FP8:
                exponentiate_e4m3(acc_s[mt], S_N_TILES, m_run[mt], l_run[mt], scale_log2)
                pack_p_e4m3(p_frag[mt], acc_s[mt], P_STEPS)
            else:
                exponentiate(acc_s[mt], S_N_TILES, m_run[mt], l_run[mt], scale_log2)
                pack_p_fragments(p_frag[mt], acc_s[mt], P_K_TILES, BF16)

    @cuda.jit(device=True, forceinline=True)
    def online_softmax(acc_s, acc_o, p_frag, m_run, l_run, mx, scale_log2):
        """S -> P (16-bit fragments) in the exp2 domain, row maxes refreshed lazily."""
        refresh_row_maxes(acc_s, acc_o, m_run, l_run, mx, scale_log2)
        exponentiate_tile(acc_s, p_frag, m_run, l_run, scale_log2)

    return SoftmaxSteps(start_rows, cap, refresh_row_maxes, exponentiate_tile, online_softmax,
                        softmax_into_pv)


def make_masker(shape: MmaShape, causal: bool, window: bool) -> Masker:
    """-inf on the scores a warp's rows do not see: keys past the end, after the causal
    diagonal, or outside the sliding window.

    ``mask_tile(acc_s, n0, at, band)``: a tile of consecutive query rows (the forward's; ``at`` a
    ``blocks.ScoreMask`` with the warp's first row, keys from ``n0``; ``band`` a ``blocks.Band``),
    masked only where the tile crosses the end of the keys, the diagonal or an edge of the window.
    ``mask_rows(acc_s, key0, lane, total, upper, lower)``: rows of any queries (decode's packed
    rows): fragment row (mt, r) sees the keys ``lower[mt, r] <= j <= upper[mt, r]`` (``upper``:
    causal or window; ``lower``: window) below ``total``; this warp's keys from ``key0``."""
    MT = shape.m_tiles
    KEYS = shape.keys
    S_N_TILES = KEYS // 8
    CAUSAL = causal
    WINDOW = window

    @cuda.jit(device=True, forceinline=True)
    def mask_tile(acc_s, n0, at, band):
        if WINDOW:
            if band_needs_mask(n0, KEYS, at.row_first, 16 * MT, band):  # an edge of the window or the keys
                for mt in range(MT):
                    mask_band(acc_s[mt], S_N_TILES, n0, at.row_first + 16 * mt, at.lane, band)
        elif n0 + KEYS > at.seqlen_k or (CAUSAL and n0 + KEYS - 1 > at.row_first + at.diag):
            for mt in range(MT):  # keys past the end, and (causal) after the diagonal
                mask_scores(acc_s[mt], S_N_TILES, n0, at.row_first + 16 * mt, at.lane, at.seqlen_k, at.diag,
                            CAUSAL)

    @cuda.jit(device=True, forceinline=True)
    def mask_rows(acc_s, key0, lane, total, upper, lower):
        for mt in range(MT):
            for j in range(S_N_TILES):
                for e in range(4):
                    key = key0 + 8 * j + 2 * (lane % 4) + e % 2
                    if key >= total or ((CAUSAL or WINDOW) and key > upper[mt, e // 2]) or (
                            WINDOW and key < lower[mt, e // 2]):
                        acc_s[mt, j, e] = NEG_INF

    return Masker(mask_tile, mask_rows)
