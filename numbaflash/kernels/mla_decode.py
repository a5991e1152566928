"""MLA decode (DeepSeek-V2/V3, Kimi K2; issue 58) on tensor cores: cp.async + ldmatrix + mma.sync,
sm_80 on.

The cache holds one latent row a token (``head_dim`` 576: 512 latent + 64 rotary values) shared by
every query head: K is the whole row, V its first ``head_dim_v`` (512) values, and the output has
V's head dim. So this is decode with one KV head (``decode_mma``'s packing: row r of a CTA is query
position r // group, query head r % group) whose V tile is its K tile: the ring holds K tiles only
(``make_decode_rows(.., v_in_k=True)``), read from HBM once.

What differs from ``decode_mma`` is the split of the work over the warps. There each warp takes its
own keys of a tile and a whole O; here O is rows x 512 float32, more than a warp's registers, so:

1. S = Q Kᵀ (``score``): warp w scores key slice w % key_warps of the tile (``score_keys`` keys) for
   the m-tiles of group w // key_warps (``score_m_tiles``), Q by k-slices from shared memory.
2. The row maxima meet in shared memory (each slice's, ``maxes_at``); every warp takes the same
   running max of every row, so the rescale factors agree without more traffic (``adopt_maxes``).
3. The scoring warps write P (16-bit A fragments, in fragment order) into shared memory; each keeps
   the partial row sums of its keys.
4. O += P V (``accumulate``): warp w takes O's columns w * value_columns .. for every row and every
   key of the tile, V read from the K tile through the transposing ldmatrix.

Three barriers a tile (the ring's, the maxima's, P's). At the end the key slices' row sums meet in
shared memory, and each warp writes its columns of O (one split: in the input dtype, with the
LSE) or of the split's float32 partials, which ``decode_mma.make_decode_combine_kernel`` merges.
Causal masking is bottom-right (query i of seqlen_q sees keys j <= L - seqlen_q + i): several
queries a sequence (multi-token prediction). No new rows, window, softcap or sink: the call
(``api.flash_mla_with_kvcache``) takes none.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

from .. import ptx
from .common import FULL_MASK, NEG_INF, THRESHOLD, unroll
from .decode_mma import KeyRows, decode_entry, decode_split, make_decode_rows, make_sequence_source
from .epilogue import log_sum_exp
from .mma_pieces import MmaShape, make_masker, make_pv_steps
from .shapes import MlaDecodeConfig
from .smem import block_offset, ldmatrix_offsets
from .softmax import exponentiate, max_grew, pack_16bit, pack_p_fragments, quad_sum, rescale_rows, row_max

# What one tile's steps share (``make_mla_walk``): the CTA's shared base and Q tile, the thread, the
# warp's key slice and first scored m-tile, the lane, the ldmatrix offsets (Q and V; K), the
# fragments (S, O, the warp's P, every P, K/V), the softmax state, and each scored fragment row's
# last key (causal).
MlaLoop = namedtuple("MlaLoop", ["base", "sq", "tid", "key_slice", "mt0", "lane", "warp", "a_offsets",
                                 "k_offsets", "acc_s", "acc_o", "q_frag", "p_mine", "p_all", "b_frag",
                                 "m_run", "l_run", "mx", "scale_log2", "upper"])

# One k-slice of the score (``score_slice``): S, Q's fragment buffer and the scored m-tiles' rows,
# the ldmatrix offsets of Q, the key slice's K rows, K's offsets and fragment buffer.
ScoreSlice = namedtuple("ScoreSlice", ["acc_s", "q_frag", "q_tile", "a_offsets", "k_tile", "k_offsets",
                                       "b_frag"])
# What the rows' writer (``write_row``) reads: the parameters, O, the running maxima, the shared
# memory (the key slices' row sums), the batch, the block's first row, the rows that exist, the
# split, the warp and the lane.
MlaRows = namedtuple("MlaRows", ["p", "acc_o", "m_run", "smem_f", "b", "r0", "rows_total", "split", "warp",
                                 "lane"])


def make_mla_walk(config: MlaDecodeConfig, causal: bool, bf16: bool):
    """The tile's steps: ``score`` (S of the warp's key slice and m-tiles, masked), ``publish_maxes``,
    ``adopt_maxes`` (every row's running max, O and the sums rescaled), ``share_p`` (the warp's P into
    shared memory) and ``accumulate`` (O's columns of the warp += P V), on ``mma_pieces``."""
    BN, BM, MT = config.block_n, config.rows, config.m_tiles
    RB = config.row_bytes
    KW = config.score_keys
    MTW = config.score_m_tiles
    DVW = config.value_columns
    S_N_TILES = KW // 8
    KW_TILES = KW // 16  # P's 16-key slices a warp scores
    P_SLICES = BN // 16  # of the tile
    O_N_TILES = DVW // 8
    MAXES = config.maxes_at // 4  # float32 index
    P_AT = config.p_at
    WK = config.key_warps
    CAUSAL = causal
    BF16 = bf16
    D_BLOCKS = config.head_dim // 64  # 64-column blocks of S = Q Kᵀ's depth (4 k-slices each)
    S_PAIRS = KW // 16  # K ldmatrix.x4 loads a k-slice (two n-tiles each)
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16
    score_shape = MmaShape(config.head_dim, BM, BN, KW, MTW, RB, 0)
    pv = make_pv_steps(MmaShape(config.head_dim, BM, BN, 16, MT, RB, DVW), False, bf16)
    mask_rows = make_masker(score_shape, causal, False).mask_rows
    pv_slice = pv.pv_slice

    @cuda.jit(device=True, forceinline=True)
    def score_slice(kt, st):
        """k-slice ``kt`` of S = Q Kᵀ, counted from the columns at ``st.q_tile`` and ``st.k_tile``
        (``st``: a ScoreSlice): the scored m-tiles' Q slice and the key slice's K pairs by ldmatrix,
        then their mma.sync."""
        for mt in range(MTW):
            q_at = st.q_tile + block_offset(st.a_offsets, kt, BM, RB) + mt * 16 * RB
            ptx.ldmatrix_x4(st.q_frag[mt, 0], q_at)
        for j2 in range(S_PAIRS):
            ptx.ldmatrix_x4(st.b_frag[0], st.k_tile + block_offset(st.k_offsets, kt, BN, RB) + j2 * 16 * RB)
            for mt in range(MTW):
                mma(st.acc_s[mt, 2 * j2], st.q_frag[mt, 0], st.b_frag[0, 0:2])
                mma(st.acc_s[mt, 2 * j2 + 1], st.q_frag[mt, 0], st.b_frag[0, 2:4])

    score_block = unroll(score_slice, 4)  # a 64-column block's four k-slices
    score_all = unroll(score_slice, D_BLOCKS * 4)  # every k-slice (NVVM leaves a 36-slice loop rolled)

    @cuda.jit(device=True, forceinline=True)
    def score(loop, sk, key0, total, diag, r0, group):
        """S of the warp's key slice (keys key0 ..) and scored m-tiles against the K tile at ``sk``;
        -inf past the keys and (causal) after each row's diagonal. One scored m-tile: a loop over
        the 64-column blocks, four k-slices each (NVVM unrolls it all the same: the same instruction
        count, half the compile time); two or more: every k-slice unrolled in Python (the loop, left
        partly rolled there, was 1.5% slower at 64 and 128 heads). (S over 2 or 4 accumulator sets,
        against the chain of 36 dependent mma.sync: no gain.) docs/PERFORMANCE.md [MLA]."""
        for i in range(MTW):
            for j in range(S_N_TILES):
                for e in range(4):
                    loop.acc_s[i, j, e] = 0.0
        q_tile = loop.sq + loop.mt0 * 16 * RB
        k_tile = sk + loop.key_slice * KW * RB
        if MTW > 1:
            score_all(ScoreSlice(loop.acc_s, loop.q_frag, q_tile, loop.a_offsets, k_tile, loop.k_offsets,
                                 loop.b_frag))
        else:
            for block in range(D_BLOCKS):
                score_block(ScoreSlice(loop.acc_s, loop.q_frag, q_tile + block * (BM * RB), loop.a_offsets,
                                       k_tile + block * (BN * RB), loop.k_offsets, loop.b_frag))
        if key0 + KW > total or (CAUSAL and key0 + KW - 1 > diag + (r0 + 16 * loop.mt0) // group):
            mask_rows(loop.acc_s, key0, loop.lane, total, loop.upper, loop.upper)

    @cuda.jit(device=True, forceinline=True)
    def publish_maxes(smem_f, loop):
        """The scored rows' maxima over the warp's keys (scaled, log2 units) into shared memory."""
        g = loop.lane // 4
        for i in range(MTW):
            for r in range(2):
                m = row_max(loop.acc_s[i], S_N_TILES, r) * loop.scale_log2
                if loop.lane % 4 == 0:
                    smem_f[MAXES + loop.key_slice * BM + 16 * (loop.mt0 + i) + g + 8 * r] = m

    @cuda.jit(device=True, forceinline=True)
    def adopt_maxes(smem_f, loop):
        """Every row's tile max (over the key slices), then the running maxima refreshed lazily
        (``mma_pieces``' rule: only where one grew by more than 2^THRESHOLD): every warp reads the
        same values and decides the same, so P's scale and O's agree."""
        g = loop.lane // 4
        grow = False
        for mt in range(MT):
            for r in range(2):
                t = NEG_INF
                for k in range(WK):
                    t = max(t, smem_f[MAXES + k * BM + 16 * mt + g + 8 * r])
                loop.mx[mt, r] = t
            grow = grow or max_grew(loop.mx[mt], loop.m_run[mt], THRESHOLD)
        if cuda.any_sync(FULL_MASK, grow):
            for mt in range(MT):
                rescale_rows(loop.acc_o[mt], O_N_TILES, loop.m_run[mt], loop.l_run[mt], loop.mx[mt])

    @cuda.jit(device=True, forceinline=True)
    def share_p(loop):
        """P = exp2(S - m) of the scored rows (their partial sums added), as 16-bit A fragments into
        shared memory: slot (m-tile, 16-key slice of the tile), 16 bytes a lane. The scored m-tiles'
        maxima and sums are picked from every m-tile's by compile-time compares (``mt0`` is the
        warp's, known at run time only: an index by it would put them in local memory)."""
        m_pair = cuda.local.array(2, float32)
        l_pair = cuda.local.array(2, float32)
        for i in range(MTW):
            for mt in range(MT):
                if mt == loop.mt0 + i:
                    for r in range(2):
                        m_pair[r] = loop.m_run[mt, r]
            for r in range(2):
                l_pair[r] = 0.0
            exponentiate(loop.acc_s[i], S_N_TILES, m_pair, l_pair, loop.scale_log2)
            for mt in range(MT):
                if mt == loop.mt0 + i:
                    for r in range(2):
                        loop.l_run[mt, r] += l_pair[r]
            pack_p_fragments(loop.p_mine[i], loop.acc_s[i], KW_TILES, BF16)
            for kt in range(KW_TILES):
                slot = (loop.mt0 + i) * P_SLICES + loop.key_slice * KW_TILES + kt
                ptx.st_shared_v4(loop.base + P_AT + (slot * 32 + loop.lane) * 16, loop.p_mine[i, kt])

    @cuda.jit(device=True, forceinline=True)
    def accumulate(loop, sk):
        """O's columns of the warp += P V over the tile's keys: V is the K tile's first columns, from
        column ``warp * DVW``; P's fragments from shared memory, a 16-key slice at a time."""
        v_tile = sk + (loop.warp * DVW // 64) * (BN * RB)
        for kt in range(P_SLICES):
            for mt in range(MT):
                slot = mt * P_SLICES + kt
                ptx.ld_shared_v4(loop.p_all[mt, 0], loop.base + P_AT + (slot * 32 + loop.lane) * 16)
            pv_slice(loop.acc_o, loop.p_all, v_tile + kt * 16 * RB, loop.a_offsets, loop.b_frag, 0, 0)

    return score, publish_maxes, adopt_maxes, share_p, accumulate


# The latent cache's ring (``make_latent_ring``): ``fill(base, first, last, seq, ks, tid, pending)`` copies
# the first tiles; ``advance(base, t, first, last, seq, ks, tid, pending)`` waits for tile t, starts
# tile t + stages - 1 and returns tile t's shared address.
LatentRing = namedtuple("LatentRing", ["fill", "advance"])


def make_latent_ring(config, rows) -> LatentRing:
    """The K ring of the mma.sync MLA kernel (``config`` an ``MlaDecodeConfig``; ``rows`` its
    ``decode_mma.make_decode_rows(.., v_in_k=True)``), every thread copying by cp.async: ``fill``, the
    first stages - 1 tiles, a copy group each (Q's copies, issued before, in the first), and (paged)
    the next tile's block-table look-ahead into ``pending``; ``advance`` at tile t: wait until it (and
    Q) have landed, (paged) publish the rows of tile t + stages - 1 looked up a tile ago, a CTA
    barrier (every warp is then done with tile t - 1's stage), start that tile's copy and the next
    one's look-up."""
    BN = config.block_n
    STAGES = config.stages
    RING = config.ring_at
    STAGE_BYTES = config.stage_bytes
    PAGED = config.paged
    PAGE_ROWS_AT = config.page_rows_at
    PAGE_BUFFER = BN * 16
    wait_ring, load_tiles = rows.wait_ring, rows.load_tiles
    fetch_pages, publish_pages = rows.pages.fetch_pages, rows.pages.publish_pages

    @cuda.jit(device=True, forceinline=True)
    def fill(base, first, last, seq, ks, tid, pending):
        for s in range(STAGES - 1):
            if first + s < last:
                n0 = (first + s) * BN
                page_rows = base + PAGE_ROWS_AT + (s % 2) * PAGE_BUFFER
                if PAGED:
                    fetch_pages(pending, n0, seq, tid)
                    publish_pages(page_rows, pending, ks, ks, tid)
                    cuda.syncthreads()
                load_tiles(base + RING + s * STAGE_BYTES, n0, seq, ks, ks, tid, False, page_rows, pending)
            ptx.cp_async_commit_group()
        if first + STAGES - 1 < last:
            fetch_pages(pending, (first + STAGES - 1) * BN, seq, tid)

    @cuda.jit(device=True, forceinline=True)
    def advance(base, t, first, last, seq, ks, tid, pending):
        wait_ring()  # tile t (and Q) have landed ...
        nxt = t + STAGES - 1
        page_rows = base + PAGE_ROWS_AT + ((nxt - first) % 2) * PAGE_BUFFER
        if PAGED and nxt < last:  # tile nxt's rows, looked up a tile ago, for the copies below
            publish_pages(page_rows, pending, ks, ks, tid)
        cuda.syncthreads()  # ... for everyone, and every warp is done with tile t - 1
        if nxt < last:
            load_tiles(base + RING + ((nxt - first) % STAGES) * STAGE_BYTES, nxt * BN, seq, ks, ks, tid,
                       False, page_rows, pending)
            if nxt + 1 < last:
                fetch_pages(pending, (nxt + 1) * BN, seq, tid)
        ptx.cp_async_commit_group()
        return base + RING + ((t - first) % STAGES) * STAGE_BYTES

    return LatentRing(fill, advance)


def make_mla_decode_kernel(config: MlaDecodeConfig, causal: bool, bf16: bool):
    """The MLA decode kernel (``params.DECODE``, the plain decode kernel's parameters: ``v_cache``
    and ``k_new``/``v_new`` are not read, ``heads_kv`` is 1 and ``seqlen_new`` 0): grid (num_splits,
    row_blocks, batch), ``config.threads`` threads, ``config.shared_bytes`` of dynamic shared
    memory."""
    config.check()
    BN, BM, MT = config.block_n, config.rows, config.m_tiles
    RB = config.row_bytes
    DV = config.value_dim
    DVW = config.value_columns
    O_N_TILES = DVW // 8
    MTW = config.score_m_tiles
    KW = config.score_keys
    S_N_TILES = KW // 8
    KW_TILES = KW // 16
    WK = config.key_warps
    SQ = 0
    MAXES = config.maxes_at // 4
    BF16 = bf16
    rows = make_decode_rows(config, bf16, 0, v_in_k=True)
    PAGE_ROWS = rows.pages.rows
    prepare_q = rows.prepare_q
    ring = make_latent_ring(config, rows)
    sequence_of = make_sequence_source(False, False)
    score, publish_maxes, adopt_maxes, share_p, accumulate = make_mla_walk(config, causal, bf16)

    @cuda.jit(device=True, forceinline=True)
    def write_row(k, at):
        """Fragment row k (m-tile k // 2, half k % 2) of the warp's O columns, over the key slices'
        row sums: one split, O in the input dtype (and the LSE, by warp 0); else the split's float32
        partials and LSE. ``at``: an MlaRows. Unrolled in Python (``write_rows``): a loop left rolled
        indexes O at run time, which puts it in local memory."""
        mt = k // 2
        r = k % 2
        p = at.p
        row = 16 * mt + at.lane // 4 + 8 * r
        rr = at.r0 + row
        if rr < at.rows_total:
            l_all = float32(0.0)
            for s in range(WK):
                l_all += at.smem_f[MAXES + s * BM + row]
            inv = float32(1.0) / l_all if l_all > 0 else float32(0.0)
            lse = log_sum_exp(at.m_run[mt, r], l_all)
            pos = rr // p.group
            head = rr - pos * p.group
            col0 = at.warp * DVW + 2 * (at.lane % 4)
            row_id = (at.b * p.group + head) * p.seqlen_q + pos  # one KV head: heads_q = group
            if p.num_splits == 1:
                o_at = at.b * p.o_sb + pos * p.o_ss + head * p.o_sh + col0
                for j in range(O_N_TILES):
                    packed = pack_16bit(at.acc_o[mt, j, 2 * r] * inv, at.acc_o[mt, j, 2 * r + 1] * inv, BF16)
                    p.out[uint64(o_at + 8 * j)] = uint16(packed & uint32(0xFFFF))
                    p.out[uint64(o_at + 8 * j + 1)] = uint16(packed >> uint32(16))
                if p.write_lse and at.warp == 0 and at.lane % 4 == 0:
                    p.lse[uint64(row_id)] = lse
            else:
                part = (row_id * p.num_splits + at.split) * DV + col0
                for j in range(O_N_TILES):
                    p.o_part[uint64(part + 8 * j)] = at.acc_o[mt, j, 2 * r] * inv
                    p.o_part[uint64(part + 8 * j + 1)] = at.acc_o[mt, j, 2 * r + 1] * inv
                if at.warp == 0 and at.lane % 4 == 0:
                    p.lse_part[uint64(row_id * p.num_splits + at.split)] = lse

    write_rows = unroll(write_row, 2 * MT)

    @cuda.jit(device=True, forceinline=True)
    def run_mla(p, window_left, window_right, cap_scale, sink, cache_batch_idx, cache_leftpad, rotary):
        """The kernel's body (``decode_mma.decode_entry``'s signature; only ``p`` is read)."""
        smem_f = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x & 1023
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        key_slice = warp % WK
        mt0 = (warp // WK) * MTW
        split = int64(cuda.blockIdx.x)
        row_block = int64(cuda.blockIdx.y)
        b = int64(cuda.blockIdx.z)
        rows_total = p.group * p.seqlen_q
        r0 = row_block * BM
        ptx.grid_dependency_wait()  # sm_90 launches this kernel programmatically: inputs after this
        seq = sequence_of(p, b, None, None, None)
        total = seq.total
        diag = total - p.seqlen_q  # query i sees keys j <= i + diag
        first, last = decode_split((total + BN - 1) // BN, p.num_splits, split)

        base = ptx.shared_address_u16(cuda.shared.array(0, types.uint16))
        sq = base + SQ
        ks = KeyRows(ptx.global_address(p.k_cache), p.kc_sb * 2, p.kc_ss * 2, int64(0), int64(0), int64(0))
        prepare_q(sq, (ptx.global_address(p.q) + b * p.q_sb * 2, p.q_ss * 2, p.q_sh * 2), int64(0), p.group,
                  rows_total, r0, tid)
        pending = cuda.local.array((PAGE_ROWS, 2), int32)  # paged: the next tile's block-table entries
        ring.fill(base, first, last, seq, ks, tid, pending)

        acc_o = cuda.local.array((MT, O_N_TILES, 4), float32)
        for mt in range(MT):
            for j in range(O_N_TILES):
                for e in range(4):
                    acc_o[mt, j, e] = 0.0
        acc_s = cuda.local.array((MTW, S_N_TILES, 4), float32)
        q_frag = cuda.local.array((MTW, 1, 4), uint32)
        p_mine = cuda.local.array((MTW, KW_TILES, 4), uint32)
        p_all = cuda.local.array((MT, 1, 4), uint32)
        b_frag = cuda.local.array((1, 4), uint32)
        m_run = cuda.local.array((MT, 2), float32)
        l_run = cuda.local.array((MT, 2), float32)
        mx = cuda.local.array((MT, 2), float32)
        upper = cuda.local.array((MTW, 2), int64)  # causal: the last key each scored fragment row sees
        for mt in range(MT):
            for r in range(2):
                m_run[mt, r] = NEG_INF
                l_run[mt, r] = 0.0
        for i in range(MTW):
            for r in range(2):
                upper[i, r] = diag + (r0 + 16 * (mt0 + i) + g + 8 * r) // p.group
        a_offsets = cuda.local.array(4, uint32)  # Q as the A operand, V as the B operand of PV
        ldmatrix_offsets(a_offsets, lane % 16, lane // 16, RB)
        k_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(k_offsets, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB)
        loop = MlaLoop(base, sq, tid, key_slice, mt0, lane, warp, a_offsets, k_offsets, acc_s, acc_o, q_frag,
                       p_mine, p_all, b_frag, m_run, l_run, mx, p.scale_log2, upper)

        for t in range(first, last):
            sk = ring.advance(base, t, first, last, seq, ks, tid, pending)
            score(loop, sk, t * BN + key_slice * KW, total, diag, r0, p.group)
            publish_maxes(smem_f, loop)
            cuda.syncthreads()  # every key slice's maxima are in
            adopt_maxes(smem_f, loop)
            share_p(loop)
            cuda.syncthreads()  # P is whole (and every warp has read the maxima)
            accumulate(loop, sk)

        ptx.grid_launch_dependents()  # the combine kernel (sm_90: launched programmatically) may start
        ptx.cp_async_wait_group_0()  # a split with no tile still has Q's copies in flight
        # The key slices' row sums meet where the maxima were (every warp read those before P's barrier).
        for mt in range(MT):  # the scored m-tiles' (every m-tile summed: an index chosen at run time
            for r in range(2):  # would put l_run in local memory)
                l_sum = quad_sum(l_run[mt, r])
                if mt // MTW == warp // WK and lane % 4 == 0:
                    smem_f[MAXES + key_slice * BM + 16 * mt + g + 8 * r] = l_sum
        cuda.syncthreads()
        write_rows(MlaRows(p, acc_o, m_run, smem_f, b, r0, rows_total, split, warp, lane))

    kernel = decode_entry(run_mla, False)
    kernel.__name__ = (f"flash_mla_decode_d{config.head_dim}v{DV}{config.tag}_"
                       f"{'causal' if causal else 'full'}_{'bf16' if BF16 else 'f16'}")
    kernel.launch_bounds = (config.threads, 1)
    return kernel
