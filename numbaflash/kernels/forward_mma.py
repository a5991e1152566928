"""FlashAttention-2 forward on tensor cores with cp.async + ldmatrix + mma.sync (sm_80+).

One CTA computes ``block_m`` query rows of one (batch, head); each of its warps owns 16 rows
per m-tile and keeps their Q fragments in registers for the whole KV loop (head_dim <= 128;
at 256, whose O accumulator alone is 128 registers per m-tile, it reloads them from the Q
tile one 16-column k-tile at a time inside S = Q Kᵀ). K and V tiles of
``block_n`` keys stream through swizzled shared memory with cp.async; the copy of V_j
overlaps S = Q K_jᵀ and the copy of K_{j+1} overlaps O += P V_j. The softmax runs online
in the exp2 domain with the scale folded into one FFMA; P becomes the A operand of the PV
product in registers; O is rescaled only when a row max grows (``common.THRESHOLD``) and is
normalised once at the end, then written through shared memory with 16-byte stores.

With ``config.interleave_pv`` (the shipped d64 kernels) V_j is waited for right after S_j, and
the exponentials of each 16-key slice are followed by that slice's PV mma.sync with no barrier
in between, so that ptxas interleaves a warp's MUFU work with its tensor-core work.

Tiles are stored as 64-column blocks of 128-byte rows when head_dim is a multiple of 64, else
(32, 96) as 32-column blocks of 64-byte rows (``smem``); head dims 32, 64, 96, 128, 256.

Two compile-time variants (issue 35), built only when a call asks for them: ``window`` (a sliding
window, FlashAttention's ``window_size``: the KV loop runs over the tiles between the block's
window edges only, ``blocks.band_kv_tiles``, and edge tiles are masked by ``blocks.mask_band``;
the window's sizes are kernel arguments) and ``softcap`` (scores become tanh(QKᵀ · scale /
softcap) before the softmax, whose exponent factor is then softcap·log2(e): ``softmax.cap_scores``;
the factor is a kernel argument). A kernel built without them compiles to the same code as
before they existed: their arguments are never read.

A third, ``varlen`` (packed variable-length batches, ``flash_attention_varlen``), is a kernel of its
own parameter list (``VARLEN_ARGTYPES``): the plain parameters, then the int32 cumulative offsets
of the sequences' queries and keys (batch + 1,) and the LSE's head stride (total_q). It calls the
same body as a device function, with a ``Sequences`` record in the ``batch_size`` slot: grid z is
the sequence, whose rows start at ``cu_seqlens_q[b]`` (two int32 loads each for q and k), and
whose own lengths replace seqlen_q and seqlen_k (so masks, causal diagonal and window are per
sequence, and no tile reads or writes a row of another sequence); a query block past its
sequence's end returns at once. The LSE is (heads_q, total_q). The other builds never see it.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int64, types, uint32

from .. import ptx
from .blocks import (
    Band,
    band_kv_tiles,
    band_needs_mask,
    mask_band,
    mask_scores,
    query_block,
    visible_kv_tiles,
)
from .common import FULL_MASK, NEG_INF, THRESHOLD, keep_in_register, unroll
from .epilogue import stage_output_rows, store_lse, store_rows_global
from .shapes import ForwardConfig
from .smem import (
    block_offset,
    copy_tile_async,
    drain_copies,
    global_rows,
    ldmatrix_offsets,
    load_a_fragments,
)
from .softmax import (
    cap_scores,
    exponent_offsets,
    exponentiate,
    exponentiate_slice,
    max_grew,
    pack_p_fragments,
    pack_p_slice,
    rescale_rows,
    scaled_row_maxes,
)

# What the interleaved softmax + PV slices share (``slice_into_pv``): S (exponentiated in place),
# O, P fragments, the exponent offsets and partial row sums of every m-tile, the softmax scale,
# and V's tile, ldmatrix offsets and fragment buffer.
PvSlices = namedtuple("PvSlices", ["acc_s", "acc_o", "p_frag", "m_use", "row_sum", "scale_log2", "v_tile",
                                   "v_offsets", "b_frag"])
# What a varlen kernel passes in the body's ``batch_size`` slot: the number of sequences, the
# int32 cumulative offsets of their queries and keys (count + 1,), and the LSE's head stride.
Sequences = namedtuple("Sequences", ["count", "cu_seqlens_q", "cu_seqlens_k", "lse_head_stride"])


def make_forward_kernel(config: ForwardConfig, causal: bool, bf16: bool, window: bool = False,
                        softcap: bool = False, varlen: bool = False):
    """Return the Python kernel function for ``config`` (jit it with ``common.FORWARD_ARGTYPES``).

    Launch: grid ``launch_forward.forward_grid``, ``config.threads`` threads,
    ``config.shared_bytes`` bytes of dynamic shared memory.

    ``window``: a sliding-window kernel (``window_left`` / ``window_right`` arguments, each >= 0;
    ``causal`` must then be False: the window's right edge 0 is causal masking). ``softcap``:
    scores capped by tanh (``cap_scale`` argument = softmax_scale / softcap, and ``scale_log2`` =
    softcap·log2(e)). Kernels without them never read those arguments. ``varlen``: the packed
    variable-length kernel (jit it with ``common.VARLEN_ARGTYPES``; grid
    ``launch_forward.forward_grid(query blocks of max_seqlen_q, heads_q, batch)``).
    """
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    config.check()
    D = config.head_dim
    BM = config.block_m
    BN = config.block_n
    MT = config.warp_m_tiles
    THREADS = config.threads
    CPR = D // 8  # 16-byte chunks per row
    RB = 128 if D % 64 == 0 else 64  # bytes per row of a swizzle column block (smem)
    Q_RESIDENT = config.q_in_regs  # Q fragments in registers for the whole loop, else per k-slice
    DOUBLE_BUFFER = config.double_buffer
    EARLY_K = config.early_k
    # With a softcap the interleaved softmax + PV spills (d64 128 x 128: 34 LDL/STL at sm_80, the
    # tanh pass on top of a 255-register kernel): softcap kernels run the plain order instead.
    INTERLEAVE = config.interleave_pv and not softcap
    D_K_TILES = D // 16  # k-tiles of the QKᵀ product
    D_N_TILES = D // 8  # n-tiles of the O accumulator
    S_N_TILES = BN // 8  # n-tiles of the S accumulator
    P_K_TILES = BN // 16  # k-tiles of the PV product
    S_PAIRS = S_N_TILES // 2  # K ldmatrix.x4 loads per k-slice (two n-tiles each)
    O_PAIRS = D_N_TILES // 2  # V ldmatrix.x4 loads per k-slice
    S_STEPS = D_K_TILES * S_PAIRS  # K loads of one S product (even: D_K_TILES is)
    O_STEPS = P_K_TILES * O_PAIRS  # V loads of one PV product (even: O_PAIRS is)
    Q_BUFFERS = 2 if DOUBLE_BUFFER else 1  # Q k-slice buffers when Q is not resident
    CAUSAL = causal
    WINDOW = window
    SOFTCAP = softcap
    VARLEN = varlen
    REVERSE = causal or window  # heaviest query blocks first (blocks.query_block)
    BF16 = bf16
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    @cuda.jit(device=True, forceinline=True)
    def load_q_slice(q_frag, buf, q_tile, a_offsets, kt):
        """ldmatrix k-slice ``kt`` of the warp's Q rows (every m-tile) into ``q_frag[:, buf]``."""
        for mt in range(MT):
            ptx.ldmatrix_x4(q_frag[mt, buf], q_tile + block_offset(a_offsets, kt, BM, RB) + mt * 16 * RB)

    @cuda.jit(device=True, forceinline=True)
    def k_load(b_frag, buf, k_tile, k_offsets, i):
        """ldmatrix K fragment pair ``i`` (k-slice ``i // S_PAIRS``, n-tiles 2j2, 2j2+1 with
        ``j2 = i % S_PAIRS``) into ``b_frag[buf]``."""
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
    def qk_scores(acc_s, q_frag, q_tile, a_offsets, k_tile, k_offsets, b_frag):
        """S = Q K_jᵀ for the warp's m-tiles: K fragments by ldmatrix, two n-tiles per load.
        Q fragments: ``q_frag[mt, kt]`` held in registers (Q_RESIDENT), or loaded k-slice by
        k-slice from the warp's rows of the Q tile at ``q_tile`` into ``q_frag[mt, buf]``.
        With DOUBLE_BUFFER the next K load (and the next Q slice) is issued before the
        current mma.sync, into the other half of ``b_frag`` (``q_frag``); the steps go in
        pairs so that every buffer index is a constant before unrolling."""
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
        for kt in range(D_K_TILES):
            qt = kt
            if not Q_RESIDENT:
                qt = 0
                if kt > 0:
                    load_q_slice(q_frag, 0, q_tile, a_offsets, kt)
            for j2 in range(S_PAIRS):
                ptx.ldmatrix_x4(b_frag[0], k_tile + block_offset(k_offsets, kt, BN, RB) + j2 * 16 * RB)
                for mt in range(MT):
                    mma(acc_s[mt, 2 * j2], q_frag[mt, qt], b_frag[0, 0:2])
                    mma(acc_s[mt, 2 * j2 + 1], q_frag[mt, qt], b_frag[0, 2:4])

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
    def pv_slice(acc_o, p_frag, v_tile, v_offsets, b_frag, kt):
        """O += P V_j over the 16 keys of k-slice ``kt``: P from registers, V fragments by
        transposing ldmatrix. With DOUBLE_BUFFER each step loads the next V pair (the first
        of the next slice at the end) before its mma.sync; ``v_load(.., 0)`` starts it."""
        if DOUBLE_BUFFER:
            for p in range(O_PAIRS // 2):
                i = kt * O_PAIRS + 2 * p
                pv_step(acc_o, p_frag, v_tile, v_offsets, b_frag, 0, i)
                pv_step(acc_o, p_frag, v_tile, v_offsets, b_frag, 1, i + 1)
            return
        for j2 in range(O_PAIRS):
            ptx.ldmatrix_x4_trans(b_frag[0], v_tile + block_offset(v_offsets, j2, BN, RB) + kt * 16 * RB)
            for mt in range(MT):
                mma(acc_o[mt, 2 * j2], p_frag[mt, kt], b_frag[0, 0:2])
                mma(acc_o[mt, 2 * j2 + 1], p_frag[mt, kt], b_frag[0, 2:4])

    @cuda.jit(device=True, forceinline=True)
    def pv_accumulate(acc_o, p_frag, v_tile, v_offsets, b_frag):
        """O += P V_j, k-slice by k-slice."""
        if DOUBLE_BUFFER:
            v_load(b_frag, 0, v_tile, v_offsets, 0)
        for kt in range(P_K_TILES):
            pv_slice(acc_o, p_frag, v_tile, v_offsets, b_frag, kt)

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
        pv_slice(state.acc_o, p_frag, state.v_tile, state.v_offsets, state.b_frag, kt)

    slices_into_pv = unroll(slice_into_pv, P_K_TILES)

    @cuda.jit(device=True, forceinline=True)
    def softmax_into_pv(acc_s, acc_o, p_frag, m_run, l_run, mx, scale_log2, v_tile, v_offsets, b_frag):
        """The online softmax and O += P V_j as one stretch of code with no barrier: the
        exponentials of each 16-key slice, then that slice's PV mma.sync, so that a warp's
        MUFU work on slice kt + 1 can overlap its tensor-core work on slice kt."""
        if DOUBLE_BUFFER:
            v_load(b_frag, 0, v_tile, v_offsets, 0)  # V_j has landed: needs no row max
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
    def online_softmax(acc_s, acc_o, p_frag, m_run, l_run, mx, scale_log2):
        """S -> P (16-bit fragments) in the exp2 domain, row maxes refreshed lazily."""
        refresh_row_maxes(acc_s, acc_o, m_run, l_run, mx, scale_log2)
        for mt in range(MT):
            exponentiate(acc_s[mt], S_N_TILES, m_run[mt], l_run[mt], scale_log2)
            pack_p_fragments(p_frag[mt], acc_s[mt], P_K_TILES, BF16)

    def flash_forward(q, k, v, o, lse, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                      o_sb, o_ss, o_sh, seqlen_q, seqlen_k, batch_size, heads_q, group, scale_log2,
                      write_lse, window_left, window_right, cap_scale):
        smem = cuda.shared.array(0, types.uint16)
        tid = cuda.threadIdx.x & 1023  # known to be in [0, 1024): its // and % are shifts and masks
        warp = tid // 32
        lane = tid % 32
        m_block, head, batch, kv_head = query_block(heads_q, group, REVERSE)
        if VARLEN:  # batch_size is a Sequences record: this CTA's sequence and its own lengths
            seqs = batch_size
            if batch >= seqs.count:
                return
            start_q = int64(seqs.cu_seqlens_q[batch])
            seqlen_q = int64(seqs.cu_seqlens_q[batch + 1]) - start_q
            if m_block * BM >= seqlen_q:  # past this sequence's queries (or an empty sequence)
                return
            start_k = int64(seqs.cu_seqlens_k[batch])
            seqlen_k = int64(seqs.cu_seqlens_k[batch + 1]) - start_k
        elif batch >= batch_size:  # past the last (batch, head) pair of a folded grid
            return
        m0 = m_block * BM
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag

        sq = ptx.shared_address_u16(smem)
        sk = sq + BM * D * 2
        sv = sk + BN * D * 2
        if VARLEN:  # rows from the sequence's first (a Sequences record holds no batch strides)
            q_rows = global_rows(q, start_q * q_ss + head * q_sh, q_ss, seqlen_q)
            k_rows = global_rows(k, start_k * k_ss + kv_head * k_sh, k_ss, seqlen_k)
            v_rows = global_rows(v, start_k * v_ss + kv_head * v_sh, v_ss, seqlen_k)
        else:
            q_rows = global_rows(q, batch * q_sb + head * q_sh, q_ss, seqlen_q)
            k_rows = global_rows(k, batch * k_sb + kv_head * k_sh, k_ss, seqlen_k)
            v_rows = global_rows(v, batch * v_sb + kv_head * v_sh, v_ss, seqlen_k)

        n_tiles = visible_kv_tiles(m0, BM, BN, seqlen_k, diag, CAUSAL)
        kv_first = int64(0)  # the loop reads KV tiles kv_first .. kv_first + n_tiles - 1
        band = Band(seqlen_k, diag - window_left, diag + window_right)  # read by WINDOW kernels only
        if WINDOW:
            kv_first, kv_end = band_kv_tiles(m0, min(BM, seqlen_q - m0), BN, band)
            n_tiles = kv_end - kv_first

        # Prologue: Q and K_0 in flight together.
        copy_tile_async(sq, BM, q_rows, m0, CPR, tid, THREADS, RB)
        ptx.cp_async_commit_group()
        if n_tiles > 0:
            copy_tile_async(sk, BN, k_rows, kv_first * BN, CPR, tid, THREADS, RB)
        ptx.cp_async_commit_group()

        acc_o = cuda.local.array((MT, D_N_TILES, 4), float32)
        for mt in range(MT):
            for j in range(D_N_TILES):
                for e in range(4):
                    acc_o[mt, j, e] = 0.0
        acc_s = cuda.local.array((MT, S_N_TILES, 4), float32)
        q_frag = cuda.local.array((MT, D_K_TILES if Q_RESIDENT else Q_BUFFERS, 4), uint32)
        p_frag = cuda.local.array((MT, P_K_TILES, 4), uint32)
        b_frag = cuda.local.array((2, 4), uint32)  # K or V fragments (two buffers: DOUBLE_BUFFER)
        # Per fragment row (m-tile mt, half r: rows g and g+8): running max (scaled, log2
        # units) and this lane's partial row sum.
        m_run = cuda.local.array((MT, 2), float32)
        l_run = cuda.local.array((MT, 2), float32)
        for mt in range(MT):
            for r in range(2):
                m_run[mt, r] = NEG_INF
                l_run[mt, r] = 0.0

        ptx.cp_async_wait_group_1()  # Q has landed (K_0 may still be in flight)
        cuda.syncthreads()
        warp_row = warp * 16 * MT  # this warp's first row in the CTA tile
        if Q_RESIDENT:
            for mt in range(MT):
                load_a_fragments(q_frag[mt], sq, warp_row + 16 * mt, D_K_TILES, BM, lane, RB)
        q_warp = sq + warp_row * RB  # the warp's rows of the Q tile (a multiple of 16 rows in)

        row_first = m0 + warp_row  # this warp's first query row
        # ldmatrix byte offsets of this lane: K as the B operand of QKᵀ (non-transposed,
        # two n-tiles of 8 keys per load), V as the B operand of PV (transposed), which is
        # also the pattern of Q as the A operand.
        k_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(k_offsets, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB)
        v_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(v_offsets, lane % 16, lane // 16, RB)
        for b in range(RB // 32):  # computed once: keep them in registers (see keep_in_register)
            k_offsets[b] = keep_in_register(k_offsets[b], lane)
            v_offsets[b] = keep_in_register(v_offsets[b], lane)
        mx = cuda.local.array((MT, 2), float32)
        for n_block in range(n_tiles):
            n0 = (kv_first + n_block) * BN
            # 0, but not provably so: the copies' per-pass shared addresses then stay base +
            # immediate instead of being hoisted out of the loop into registers (which spill).
            zero = uint32(n0 >> 62)
            ptx.cp_async_wait_group_0()  # K_j has landed ...
            cuda.syncthreads()  # ... for everyone, and every warp is done with V_{j-1}
            copy_tile_async(sv + zero, BN, v_rows, n0, CPR, tid, THREADS, RB)
            ptx.cp_async_commit_group()

            qk_scores(acc_s, q_frag, q_warp + zero, v_offsets, sk, k_offsets, b_frag)
            if INTERLEAVE:
                ptx.cp_async_wait_group_0()  # V_j has landed (the barrier below: for everyone)
            if INTERLEAVE or EARLY_K:
                cuda.syncthreads()  # every warp is done with K_j: K_{j+1} overlaps the softmax
                if n_block + 1 < n_tiles:
                    copy_tile_async(sk + zero, BN, k_rows, n0 + BN, CPR, tid, THREADS, RB)
                ptx.cp_async_commit_group()  # (empty on the last tile: the waits stay right)
            if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
                for mt in range(MT):
                    cap_scores(acc_s[mt], S_N_TILES, cap_scale)
            if WINDOW:
                if band_needs_mask(n0, BN, row_first, 16 * MT, band):  # an edge of the window or the keys
                    for mt in range(MT):
                        mask_band(acc_s[mt], S_N_TILES, n0, row_first + 16 * mt, lane, band)
            elif n0 + BN > seqlen_k or (CAUSAL and n0 + BN - 1 > row_first + diag):
                for mt in range(MT):  # keys past the end, and (causal) after the diagonal
                    mask_scores(acc_s[mt], S_N_TILES, n0, row_first + 16 * mt, lane, seqlen_k, diag, CAUSAL)
            if INTERLEAVE:
                softmax_into_pv(acc_s, acc_o, p_frag, m_run, l_run, mx, scale_log2, sv, v_offsets, b_frag)
            else:
                online_softmax(acc_s, acc_o, p_frag, m_run, l_run, mx, scale_log2)
                if EARLY_K:
                    ptx.cp_async_wait_group_1()  # V_j has landed (K_{j+1} may still be in flight) ...
                    cuda.syncthreads()  # ... for everyone
                else:
                    ptx.cp_async_wait_group_0()  # V_j has landed ...
                    cuda.syncthreads()  # ... for everyone, and every warp is done with K_j
                    if n_block + 1 < n_tiles:
                        copy_tile_async(sk + zero, BN, k_rows, n0 + BN, CPR, tid, THREADS, RB)
                        ptx.cp_async_commit_group()
                pv_accumulate(acc_o, p_frag, sv, v_offsets, b_frag)

        # Epilogue: normalise, stage this warp's rows in its own part of the Q tile, then
        # 16-byte coalesced stores. Rows with no visible key give 0 and LSE -inf.
        drain_copies()  # no copy may land on the staged rows (none is in flight today)
        for mt in range(MT):
            stage_output_rows(sq, acc_o[mt], D_N_TILES, BM, warp_row + 16 * mt, l_run[mt], lane, BF16, RB)
            if write_lse:
                if VARLEN:  # the LSE is (heads_q, total_q): rows at the sequence's global index
                    lse_base = head * seqs.lse_head_stride + start_q
                else:
                    lse_base = (batch * heads_q + head) * seqlen_q
                store_lse(lse, lse_base, row_first + 16 * mt, seqlen_q, m_run[mt], l_run[mt], lane)
        cuda.syncwarp()
        scratch = cuda.local.array(4, uint32)
        if VARLEN:
            o_rows = global_rows(o, start_q * o_ss + head * o_sh, o_ss, seqlen_q)
        else:
            o_rows = global_rows(o, batch * o_sb + head * o_sh, o_ss, seqlen_q)
        store_rows_global(o_rows, row_first, sq, BM, warp_row, 16 * MT, CPR, lane, scratch, RB)

    mask_kind = "window" if window else "causal" if causal else "full"
    kind = f"{mask_kind}{'_softcap' if softcap else ''}_{'bf16' if bf16 else 'f16'}"
    if varlen:
        kind = f"varlen_{kind}"
    tag = config.tag.replace("_ip", "") if config.interleave_pv and not INTERLEAVE else config.tag
    flash_forward.__name__ = f"flash_forward_d{D}_m{BM}x{MT}_n{BN}{tag}_{kind}"
    # ptxas may use 65536 / (threads * min_ctas) registers a thread (at most 255).
    flash_forward.launch_bounds = (THREADS, config.min_ctas)
    if not VARLEN:
        return flash_forward
    body = cuda.jit(device=True, forceinline=True)(flash_forward)

    def flash_forward_varlen(q, k, v, o, lse, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                             o_sb, o_ss, o_sh, seqlen_q, seqlen_k, batch_size, heads_q, group, scale_log2,
                             write_lse, window_left, window_right, cap_scale, cu_seqlens_q, cu_seqlens_k,
                             lse_head_stride):
        body(q, k, v, o, lse, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh,
             seqlen_q, seqlen_k, Sequences(batch_size, cu_seqlens_q, cu_seqlens_k, lse_head_stride), heads_q,
             group, scale_log2, write_lse, window_left, window_right, cap_scale)

    flash_forward_varlen.__name__ = flash_forward.__name__
    flash_forward_varlen.launch_bounds = flash_forward.launch_bounds
    return flash_forward_varlen
