"""The Hopper backward's unswapped tile (``WsBackwardConfig.swapped`` False), for head dims (192,
128) (DeepSeek's prefill and training: 128 + 64 rotary for Q and K, 128 for V): FlashAttention-4's
tile for the pair, our own code.

The swapped tile (``backward_ws``) cannot take head dim 192: a warpgroup owning 64 keys would hold
their dK rows (96 floats a thread) beside dV's (64), Sᵀ's and dPᵀ's (32 each): 224 of 240
registers. Here two consumer warpgroups of 240 registers share a CTA's block of 96 keys, each
owning 48 of them for every product but dQ (dKᵀ 72 + dVᵀ 48 + S 24 + dP 24 + dQ 48 floats a
thread):

    S   = Q Kᵀ      wgmma SS m64n48: the 64 query rows x the warpgroup's 48 keys (rows are queries:
                    the forward's masks, two LSE and two D a thread)
    dP  = dO Vᵀ     wgmma SS m64n48, issued with S
    P   = exp2(S·scale·log2e − LSE₂), masked;  dS = P ∘ (dP − D)   (registers)
                    both stored, 16-bit, to shared tiles of the 64 rows x 128-byte column blocks,
                    the warpgroup's 48 keys in column block wg (``store_tile``), then a named
                    barrier of both warpgroups
    dVᵀ += dOᵀ P    wgmma SS m64n48 for V's two 64-column m-tiles, the warpgroup's own P
    dQ  = dS K      wgmma SS m64n96: the warpgroup's 96 head-dim columns over all 96 keys (both
                    warpgroups' dS; K's columns 96 wg ..: three of its 32-column blocks, as K's tile
                    is in 64-byte rows, ``WsBackwardConfig.k_row_bytes``: FlashAttention-4's layout;
                    with 128-byte rows they were an m64n64 and an m64n32 reading dS twice, [SW64K])
    dKᵀ += Qᵀ dS    wgmma SS m64n48 for Q's three 64-column m-tiles, the warpgroup's own dS

dVᵀ, dQ and dKᵀ are issued in that order; once dVᵀ and dQ are done, dQ is staged in shared memory
(``stage_dq``: in ``dq_config``'s fragment order, so that a query block's accumulator rows are one
contiguous range) while dKᵀ runs, and one thread of the producer warpgroup adds it into the
accumulator with a bulk reduce (``backward_ws.make_dq_writer``; FlashAttention-4's, where every
consumer thread's ``red.global.add.v4`` stalled the step: +2-5% on an H200). To make room for the
48 KB of staged dQ, P and dS have one buffer each: a warpgroup writes step i's P after its own
GEMMs of step i - 1 are done (only it reads its P), and step i's dS once every warpgroup has
staged its dQ of step i - 1 (the staging buffer's full barrier: their dQ GEMMs, which read every
dS, are done). The rows' LSE₂ and D are read while S runs. The walk, the producer, the rows'
staging and the kernel around them are ``backward_ws``'s.

The epilogue stores dKᵀ (times the softmax scale) and dVᵀ transposed into the K and V tiles
(``fragments.store_transposed_fragment``), then every consumer warp writes 12 key rows of each out.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, uint32

from .. import ptx
from ..ptx import hopper as hp
from .blocks import band_needs_mask, mask_band, mask_scores
from .common import FULL_MASK
from .epilogue import store_rows_global
from .fragments import store_transposed_fragment
from .ring import make_ring
from .shapes import WARPGROUP_ROWS, WsBackwardConfig
from .smem import global_rows, swizzled_offset
from .softmax import cap_scores, pack_16bit
from .wgmma_gemms import make_backward_rows_gemms

WARPGROUP = 128  # threads
DS_BARRIER = 1  # named barrier of the consumer warpgroups (backward_ws's)
ONE = uint32(1)
TILE_BYTES = 256 * 16  # an n-tile of a query block's dQ (``dq_add_at``): four floats a consumer thread
DQ_N = 12  # n-tiles of a warpgroup's dQ: 96 head-dim columns

# A consumer warp's registers: S (then P), dP (then dS), dKᵀ and dVᵀ (m-tile t of the head dim as
# [t], x the warpgroup's keys) and this step's dQ (64 query rows x the warpgroup's 96 head-dim
# columns, n-tile j columns 96 wg + 8 j ..).
RowsAccumulators = namedtuple("RowsAccumulators", ["s", "dp", "dk", "dv", "dq"])
# wgmma descriptors: ring stage 0's Q and dO (K-major: A of S and dP), this warpgroup's K and V
# rows (K-major: B of S and dP), Q and dO (MN-major: A of dKᵀ and dVᵀ, m-tile t a column block on),
# this warpgroup's column block of P and dS (MN-major: B of dVᵀ and dKᵀ), the dS tile (K-major: A
# of dQ) and K's columns of its dQ (MN-major: B of dQ).
RowsDescriptors = namedtuple("RowsDescriptors", ["q", "do", "k", "v", "q_mn", "do_mn", "p_mn", "ds_mn",
                                                 "ds_k", "k_mn"])
# What a consumer reads besides its registers (``backward_ws.Io``'s fields).
RowsIo = namedtuple("RowsIo", ["descs", "tiles", "bars", "blk", "sc", "ws"])
RowsConsumerSteps = namedtuple("RowsConsumerSteps", ["consume_step"])
RowsConsumer = namedtuple("RowsConsumer", ["consume"])
RowsEpilogue = namedtuple("RowsEpilogue", ["store_dkv"])


def make_rows_consumer_steps(config: WsBackwardConfig, causal: bool, bf16: bool, rings, stage_rows,
                             dq_barriers, window: bool = False,
                             softcap: bool = False) -> RowsConsumerSteps:
    """One step of the walk for a consumer warpgroup of the unswapped tile (``rings``:
    ``backward_ws.Rings``; ``stage_rows``: ``backward_ws.make_row_staging``'s; ``dq_barriers``:
    ``backward_ws.DqWriter``'s, the staging buffer's mbarriers)."""
    D, DV, BM, BN = config.head_dim, config.value_dim, config.block_m, config.block_n
    CONSUMER_THREADS = config.consumers * WARPGROUP
    ROWS_BYTES = config.layout.rows_stage
    DO_STAGE = config.layout.do_stage
    KEYS = BN // config.consumers  # keys of a warpgroup: 48
    S_N = KEYS // 8  # n-tiles of S and dP
    D_TILES, V_TILES = D // WARPGROUP_ROWS, DV // WARPGROUP_ROWS  # m-tiles of dKᵀ and dVᵀ
    CAUSAL, WINDOW, SOFTCAP, BF16 = causal, window, softcap, bf16
    dq_ring = make_ring(1)  # the staged dQ (``backward_ws.make_dq_writer``)
    ring = rings.step
    gemms = make_backward_rows_gemms(BM, BN, KEYS, bf16)

    @cuda.jit(device=True, forceinline=True)
    def mask_rows(acc_s, blk, m0, seat, seqlen_k):
        """Scores of keys past the last, causal after the diagonal, or outside the window: -inf
        (only on tiles that hold one: the warp's 16 query rows x the warpgroup's keys)."""
        key0 = blk.n0 + seat.wg * KEYS
        row0 = m0 + seat.warp * 16
        if WINDOW:
            if band_needs_mask(key0, KEYS, row0, 16, blk.band):
                mask_band(acc_s, S_N, key0, row0, seat.lane, blk.band)
        elif key0 + KEYS > seqlen_k or (CAUSAL and key0 + KEYS - 1 > row0 + blk.diag):
            mask_scores(acc_s, S_N, key0, row0, seat.lane, seqlen_k, blk.diag, CAUSAL)

    @cuda.jit(device=True, forceinline=True)
    def store_tile(tile, acc, seat):
        """This warp's 16 query rows x the warpgroup's keys of P (or dS), 16-bit, into column block
        wg of a P / dS tile (``block_m`` query rows of 128-byte column blocks): one stmatrix.x4 per
        two n-tiles, word i the 8x8 matrix (n-tile 2 p + i // 2, row half i % 2), whose row r lane
        8 i + r addresses."""
        regs = cuda.local.array(4, uint32)
        matrix = seat.lane // 8
        row = seat.warp * 16 + (matrix % 2) * 8 + seat.lane % 8
        for pair in range(S_N // 2):
            for i in range(4):
                j = 2 * pair + i // 2
                h = i % 2
                regs[i] = pack_16bit(acc[j, 2 * h], acc[j, 2 * h + 1], BF16)
            chunk = seat.wg * 8 + 2 * pair + matrix // 2
            hp.stmatrix_x4(uint32(tile + swizzled_offset(row, chunk, BM, 128)), regs)

    @cuda.jit(device=True, forceinline=True)
    def stage_dq(acc_q, tiles, bars, i, turn, seat):
        """This step's dQ into the staging buffer (and thread 0 its ``turn`` after it: the dQ
        writer's in deterministic mode) once the bulk reduce of the step before has read it, then
        one arrival a warp. Columns 96 wg + 8 j (n-tile j) sit at 16 (256 j + thread) bytes
        (``WsBackwardConfig.dq_add_at``)."""
        dq_bars = dq_barriers(bars)
        dq_ring.wait_empty(dq_bars, i)
        at = tiles.dq + 16 * seat.thread
        for j in range(DQ_N):
            ptx.st_shared_v4_f32(at + j * TILE_BYTES, acc_q[j, 0], acc_q[j, 1], acc_q[j, 2], acc_q[j, 3])
        if seat.thread == 0:
            ptx.st_shared_b32(tiles.dq + DQ_N * TILE_BYTES, uint32(turn))
        hp.fence_proxy_async_shared_cta()  # the bulk reduce reads through the async proxy
        cuda.syncwarp(FULL_MASK)
        if seat.lane == 0:
            hp.mbarrier_arrive(dq_bars.full)

    @cuda.jit(device=True, forceinline=True)
    def consume_step(acc, io, step, seat):
        """One query block for this warpgroup: S and dP, P and dS through shared memory, dVᵀ, dQ
        (staged) and dKᵀ; the stage is released at the end."""
        descs, tiles, bars, blk = io.descs, io.tiles, io.bars, io.blk
        sc, ws = io.sc, io.ws
        i = step.i
        s = ring.slot(i)
        q_at = ring.offset(s)
        do_at = s * uint32(DO_STAGE)
        parity = i & ONE
        # the other rows buffer's last reads were before the previous step's barrier
        if step.next_row >= 0:
            stage_rows(tiles, ws, step.next_row, parity ^ ONE, seat)
        ring.wait_full(bars, i)
        gemms.issue_s(acc.s, hp.descriptor_add(descs.q, q_at), descs.k, D)
        gemms.issue_dp(acc.dp, hp.descriptor_add(descs.do, do_at), descs.v, DV)
        # the thread's two query rows' LSE₂ and D (rows 16 warp + lane // 4 and 8 on), read while S runs
        rows_at = parity * uint32(ROWS_BYTES) + (seat.warp * uint32(16) + seat.lane // uint32(4)) * uint32(4)
        lse0 = ptx.ld_shared_f32(tiles.lse + rows_at)
        lse1 = ptx.ld_shared_f32(tiles.lse + rows_at + 32)
        d0 = ptx.ld_shared_f32(tiles.delta + rows_at)
        d1 = ptx.ld_shared_f32(tiles.delta + rows_at + 32)
        hp.wgmma_wait_group_1()
        gemms.fence_scores(acc.s)
        if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
            cap_scores(acc.s, S_N, sc.cap_scale)
        mask_rows(acc.s, blk, step.m0, seat, blk.band.seqlen_k)
        if not SOFTCAP:  # P now, while dP runs (this warpgroup's dVᵀ of the step before is done)
            for h in range(2):
                lse = lse1 if h else lse0
                for j in range(S_N):
                    for e in range(2):
                        acc.s[j, 2 * h + e] = ptx.exp2(acc.s[j, 2 * h + e] * sc.scale_log2 - lse)
            store_tile(tiles.p, acc.s, seat)
        hp.wgmma_wait_group_0()
        gemms.fence_scores(acc.dp)
        for h in range(2):
            d = d1 if h else d0
            lse = lse1 if h else lse0
            for j in range(S_N):
                for e in range(2):
                    x = 2 * h + e
                    if SOFTCAP:  # s = t = tanh(.): dS = P (dP − D)(1 − t²) (see backward_mma)
                        t = acc.s[j, x]
                        acc.dp[j, x] = (acc.dp[j, x] - d) * max(float32(1.0) - t * t, float32(0.0))
                        acc.s[j, x] = ptx.exp2(t * sc.scale_log2 - lse)
                        acc.dp[j, x] = acc.s[j, x] * acc.dp[j, x]
                    else:
                        acc.dp[j, x] = acc.s[j, x] * (acc.dp[j, x] - d)
        if SOFTCAP:
            store_tile(tiles.p, acc.s, seat)
        if i > 0:  # every warpgroup's dQ of the step before, which read this dS tile, is staged
            dq_ring.wait_full(dq_barriers(bars), i - ONE)
        store_tile(tiles.ds, acc.dp, seat)
        hp.fence_proxy_async_shared_cta()
        ptx.cp_async_wait_group_0()  # the next step's rows
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)  # every warpgroup's P and dS, the next rows
        gemms.issue_dkv(acc.dv, hp.descriptor_add(descs.do_mn, do_at), descs.p_mn, V_TILES)
        gemms.issue_dq(acc.dq, descs.ds_k, descs.k_mn)
        gemms.issue_dkv(acc.dk, hp.descriptor_add(descs.q_mn, q_at), descs.ds_mn, D_TILES)
        hp.wgmma_wait_group_1()  # dVᵀ and dQ done; dKᵀ may still run
        gemms.fence_dq(acc.dq)
        stage_dq(acc.dq, tiles, bars, i, step.turn, seat)
        hp.wgmma_wait_group_0()
        gemms.fence_dkv(acc.dk, D_TILES)
        gemms.fence_dkv(acc.dv, V_TILES)
        ring.release(bars, i, seat.lane)

    return RowsConsumerSteps(consume_step)


def make_rows_consumer(config: WsBackwardConfig, walk_steps) -> RowsConsumer:
    """A consumer warpgroup of the unswapped tile: its registers and wgmma descriptors, then the walk
    (``walk_steps``: ``backward_ws.make_consumer_walk``'s over ``make_rows_consumer_steps``); dKᵀ and
    dVᵀ stay in registers throughout."""
    D, DV, BM, BN = config.head_dim, config.value_dim, config.block_m, config.block_n
    KEYS = BN // config.consumers
    S_N = KEYS // 8  # n-tiles of S and dP, and of dKᵀ and dVᵀ (its own keys)
    D_TILES, V_TILES = D // WARPGROUP_ROWS, DV // WARPGROUP_ROWS

    @cuda.jit(device=True, forceinline=True)
    def consume(tiles, bars, kv_bar, blk, seat, sc, ws, heads_q, group, counters_per_head):
        """Every step of the walk for this warpgroup; returns dKᵀ and dVᵀ (registers)."""
        acc = RowsAccumulators(cuda.local.array((S_N, 4), float32), cuda.local.array((S_N, 4), float32),
                               cuda.local.array((D_TILES, S_N, 4), float32),
                               cuda.local.array((V_TILES, S_N, 4), float32),
                               cuda.local.array((DQ_N, 4), float32))
        for t in range(D_TILES):
            for j in range(S_N):
                for e in range(4):
                    acc.dk[t, j, e] = 0.0
                    if t < V_TILES:
                        acc.dv[t, j, e] = 0.0
        pds_at = seat.wg * (BM * 128)  # its column block of P and dS
        descs = RowsDescriptors(hp.smem_descriptor_k_sw128(tiles.q), hp.smem_descriptor_k_sw128(tiles.do),
                                # this warpgroup's key rows: of 64 bytes in K's blocks, 128 in V's
                                hp.smem_descriptor_k_sw64(tiles.k + seat.wg * (KEYS * 64)),
                                hp.smem_descriptor_k_sw128(tiles.v + seat.wg * (KEYS * 128)),
                                hp.smem_descriptor_mn_sw128(tiles.q, BM * 128),
                                hp.smem_descriptor_mn_sw128(tiles.do, BM * 128),
                                hp.smem_descriptor_mn_sw128(tiles.p + pds_at, BM * 128),
                                hp.smem_descriptor_mn_sw128(tiles.ds + pds_at, BM * 128),
                                hp.smem_descriptor_k_sw128(tiles.ds),
                                # K's columns 96 wg ..: its 32-column blocks 3 wg .. 3 wg + 2
                                hp.smem_descriptor_mn_sw64(tiles.k + seat.wg * (3 * BN * 64), BN * 64))
        walk_steps(acc, RowsIo(descs, tiles, bars, blk, sc, ws), kv_bar, seat, heads_q, group,
                   counters_per_head)
        return acc

    return RowsConsumer(consume)


def make_rows_epilogue(config: WsBackwardConfig, bf16: bool) -> RowsEpilogue:
    """A consumer warp's end of the CTA: its warpgroup's dKᵀ (times the softmax scale) and dVᵀ stored
    transposed, 16-bit, into the K and V tiles, then 12 key rows of each written out with 16-byte
    stores, none past seqlen_k."""
    D, DV, BN = config.head_dim, config.value_dim, config.block_n
    CONSUMER_THREADS = config.consumers * WARPGROUP
    KEYS = BN // config.consumers
    S_N = KEYS // 8  # n-tiles of dKᵀ and dVᵀ
    D_TILES, V_TILES = D // WARPGROUP_ROWS, DV // WARPGROUP_ROWS
    STORE_ROWS = BN // (config.consumers * 4)  # key rows each consumer warp writes out
    BF16 = bf16

    @cuda.jit(device=True, forceinline=True)
    def store_dkv(acc, tiles, blk, seat, dk, dv, dk_strides, dv_strides, scale, seqlen_k):
        """dK · scale and dV, 16-bit, through the K and V tiles (every GEMM that reads them is done:
        a barrier of the consumers first, and another once the tiles are whole): the warpgroup's
        key rows, the warp's 16 columns of each 64-column m-tile."""
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        for t in range(D_TILES):
            store_transposed_fragment(tiles.k, acc.dk[t], S_N, BN, seat.wg * KEYS,
                                      t * WARPGROUP_ROWS + seat.warp * 16, seat.lane, BF16, 128, scale)
        for t in range(V_TILES):
            store_transposed_fragment(tiles.v, acc.dv[t], S_N, BN, seat.wg * KEYS,
                                      t * WARPGROUP_ROWS + seat.warp * 16, seat.lane, BF16, 128, float32(1.0))
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        row0 = (seat.wg * 4 + seat.warp) * STORE_ROWS
        scratch = cuda.local.array(4, uint32)
        dk_rows = global_rows(dk, blk.batch * dk_strides[0] + blk.kv_head * dk_strides[2], dk_strides[1],
                              seqlen_k)
        dv_rows = global_rows(dv, blk.batch * dv_strides[0] + blk.kv_head * dv_strides[2], dv_strides[1],
                              seqlen_k)
        first = blk.n0 + row0
        store_rows_global(dk_rows, first, tiles.k, BN, row0, STORE_ROWS, D // 8, seat.lane, scratch, 128)
        store_rows_global(dv_rows, first, tiles.v, BN, row0, STORE_ROWS, DV // 8, seat.lane, scratch, 128)

    return RowsEpilogue(store_dkv)
