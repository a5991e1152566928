"""The Hopper backward's unswapped tile (``WsBackwardConfig.swapped`` False): FlashAttention-3's
head-dim-192 tile, here for head dims (192, 128) (DeepSeek's prefill and training: 128 + 64
rotary for Q and K, 128 for V). Our own code.

The swapped tile (``backward_ws``) cannot take head dim 192: a warpgroup owning 64 keys would hold
their dK rows (96 floats a thread) beside dV's (64), Sᵀ's and dPᵀ's (32 each): 224 of 240
registers. Here three consumer warpgroups share a CTA's block of 96 keys and split every product
so that each holds a third of dK (and, two of them, half of dV) in 160 registers:

    S   = Q Kᵀ      wgmma SS m64n32: the 64 query rows x the warpgroup's 32 keys (rows are queries:
                    the forward's masks, two LSE and two D a thread)
    dP  = dO Vᵀ     wgmma SS m64n32, issued with S
    P   = exp2(S·scale·log2e − LSE₂), masked;  dS = P ∘ (dP − D)   (registers)
                    both stored, 16-bit, to shared tiles of the 64 rows x the block's 96 keys
                    (``store_tile``), then a named barrier of the three warpgroups
    dQ  = dS K      wgmma SS m64n64: the warpgroup's 64 head-dim columns; added into the float32
                    accumulator in the mma.sync order of ``WsBackwardConfig.dq_config`` (``dq_add_at``)
    dKᵀ += Qᵀ dS    wgmma SS m64n96, Q's 64 head-dim columns of the warpgroup (MN-major) x the dS tile
    dVᵀ += dOᵀ P    wgmma SS m64n96, warpgroups 0 and 1 only (V's 128 columns are two m-tiles)

After the barrier, dVᵀ, dQ and dKᵀ are issued in that order, so that dQ's adds run beside dKᵀ.
The rows' LSE₂ and D are read while S runs (H200, 4k: +1.5%). P and dS have two buffers each (step
parity): a warpgroup writes step i's after the barrier of
step i - 1, which every warpgroup passes only once its GEMMs of step i - 2 are done. The walk,
the producer, the rows' staging and the kernel around them are ``backward_ws``'s.

The epilogue stores dKᵀ (times the softmax scale) and dVᵀ transposed into the K and V tiles
(``fragments.store_transposed_fragment``), then every consumer warp writes 8 rows of each out.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, uint32

from .. import ptx
from ..ptx import hopper as hp
from .blocks import band_needs_mask, mask_band, mask_scores
from .epilogue import store_rows_global
from .fragments import store_transposed_fragment
from .shapes import WARPGROUP_ROWS, WsBackwardConfig
from .smem import global_rows, swizzled_offset
from .softmax import cap_scores, pack_16bit
from .wgmma_gemms import make_backward_rows_gemms

WARPGROUP = 128  # threads
DS_BARRIER = 1  # named barrier of the consumer warpgroups (backward_ws's)
ONE = uint32(1)
KEYS = 32  # keys of a warpgroup's S and dP (block_n / consumers)
DQ_N = WARPGROUP_ROWS // 8  # n-tiles of a warpgroup's dQ: 64 head-dim columns

# A consumer warp's registers: S (then P), dP (then dS), dKᵀ and dVᵀ (its warpgroup's 64 head-dim
# rows x the block's keys) and this step's dQ (64 query rows x its 64 head-dim columns).
RowsAccumulators = namedtuple("RowsAccumulators", ["s", "dp", "dk", "dv", "dq"])
# wgmma descriptors: ring stage 0's Q and dO (K-major: A of S and dP), this warpgroup's K and V
# rows (K-major: B of S and dP), its 64 columns of Q and dO (MN-major: A of dKᵀ and dVᵀ), P and dS
# buffer 0 (MN-major: B of dVᵀ and dKᵀ; K-major: A of dQ) and its 64 columns of K (MN-major: B of dQ).
RowsDescriptors = namedtuple("RowsDescriptors", ["q", "do", "k", "v", "q_mn", "do_mn", "p_mn", "ds_mn",
                                                 "ds_k", "k_mn"])
# What a consumer reads besides its registers (``backward_ws.Io``'s fields).
RowsIo = namedtuple("RowsIo", ["descs", "tiles", "bars", "blk", "sc", "ws"])
RowsConsumerSteps = namedtuple("RowsConsumerSteps", ["consume_step"])
RowsConsumer = namedtuple("RowsConsumer", ["consume"])
RowsEpilogue = namedtuple("RowsEpilogue", ["store_dkv"])


def make_rows_consumer_steps(config: WsBackwardConfig, causal: bool, bf16: bool, rings, stage_rows, turns,
                             window: bool = False, softcap: bool = False) -> RowsConsumerSteps:
    """One step of the walk for a consumer warpgroup of the unswapped tile (``rings``:
    ``backward_ws.Rings``; ``stage_rows``: ``backward_ws.make_row_staging``'s; ``turns``:
    ``backward_ws.make_dq_turns``', deterministic mode's)."""
    D, DV, BM, BN = config.head_dim, config.value_dim, config.block_m, config.block_n
    CONSUMER_THREADS = config.consumers * WARPGROUP
    lay = config.layout
    ROWS_BYTES = lay.rows_stage
    DS_BYTES = lay.ds_bytes
    DO_STAGE = lay.do_stage
    S_N = KEYS // 8  # n-tiles of S and dP
    VALUE_WGS = DV // WARPGROUP_ROWS  # warpgroups that hold dVᵀ (its 64-row m-tiles)
    CAUSAL, WINDOW, SOFTCAP, BF16 = causal, window, softcap, bf16
    ring = rings.step
    wait_turn, pass_turn = turns
    gemms = make_backward_rows_gemms(BM, BN, KEYS, bf16)

    @cuda.jit(device=True, forceinline=True)
    def mask_rows(acc_s, blk, m0, seat, seqlen_k):
        """Scores of keys past the last, causal after the diagonal, or outside the window: -inf
        (only on tiles that hold one: the warp's 16 query rows x the warpgroup's 32 keys)."""
        key0 = blk.n0 + seat.wg * KEYS
        row0 = m0 + seat.warp * 16
        if WINDOW:
            if band_needs_mask(key0, KEYS, row0, 16, blk.band):
                mask_band(acc_s, S_N, key0, row0, seat.lane, blk.band)
        elif key0 + KEYS > seqlen_k or (CAUSAL and key0 + KEYS - 1 > row0 + blk.diag):
            mask_scores(acc_s, S_N, key0, row0, seat.lane, seqlen_k, blk.diag, CAUSAL)

    @cuda.jit(device=True, forceinline=True)
    def store_tile(tile, acc, seat):
        """This warp's 16 query rows x the warpgroup's 32 keys of P (or dS), 16-bit, into a P / dS
        tile (``block_m`` query rows of 128-byte column blocks of 64 keys): one stmatrix.x4 per two
        n-tiles, word i the 8x8 matrix (n-tile 2 p + i // 2, row half i % 2), whose row r lane
        8 i + r addresses."""
        regs = cuda.local.array(4, uint32)
        matrix = seat.lane // 8
        row = seat.warp * 16 + (matrix % 2) * 8 + seat.lane % 8
        for pair in range(S_N // 2):
            for i in range(4):
                j = 2 * pair + i // 2
                h = i % 2
                regs[i] = pack_16bit(acc[j, 2 * h], acc[j, 2 * h + 1], BF16)
            chunk = seat.wg * (KEYS // 8) + 2 * pair + matrix // 2
            hp.stmatrix_x4(uint32(tile + swizzled_offset(row, chunk, BM, 128)), regs)

    @cuda.jit(device=True, forceinline=True)
    def add_dq_columns(acc_q, at, wg):
        """The ``red.global.add.v4`` of warpgroup ``wg`` (a constant), from the thread's ``at``."""
        for j in range(DQ_N):
            col = WARPGROUP_ROWS * wg + 8 * j
            half = col // 96
            ptx.red_global_add_v4_f32(at + ((col - 96 * half) // 8) * 4096 + half * 2048, acc_q[j, 0],
                                      acc_q[j, 1], acc_q[j, 2], acc_q[j, 3])

    @cuda.jit(device=True, forceinline=True)
    def add_dq(acc_q, ws, row, seat, counter_at, turn, deterministic):
        """This step's dQ into the query block's accumulator by ``red.global.add.v4`` (four floats an
        n-tile), each at ``WsBackwardConfig.dq_add_at``: n-tile j's columns 64 wg + 8 j lie in the
        column half h = (64 wg + 8 j) // 96 of the mma.sync order, n-tile (64 wg + 8 j - 96 h) / 8 of
        its warps 4 h ..; in deterministic mode once the key blocks before this one have added."""
        if deterministic:
            wait_turn(seat, counter_at, turn)
        at = ws.dq + row * (D * 4) + 16 * (seat.thread % uint32(WARPGROUP))
        # one branch per warpgroup, each with constant offsets (offsets computed from the warpgroup
        # are eight loop invariants, which spill)
        if seat.wg == 0:
            add_dq_columns(acc_q, at, 0)
        elif seat.wg == 1:
            add_dq_columns(acc_q, at, 1)
        else:
            add_dq_columns(acc_q, at, 2)
        if deterministic:
            pass_turn(seat, counter_at)

    @cuda.jit(device=True, forceinline=True)
    def consume_step(acc, io, step, seat):
        """One query block for this warpgroup: S and dP, P and dS through shared memory, dQ's adds,
        dKᵀ and dVᵀ; the stage is released at the end."""
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
        gemms.issue_scores(acc.s, hp.descriptor_add(descs.q, q_at), descs.k, D)
        gemms.issue_scores(acc.dp, hp.descriptor_add(descs.do, do_at), descs.v, DV)
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
        buffer = parity * uint32(DS_BYTES)
        if not SOFTCAP:  # P now, while dP runs
            for h in range(2):
                lse = lse1 if h else lse0
                for j in range(S_N):
                    for e in range(2):
                        acc.s[j, 2 * h + e] = ptx.exp2(acc.s[j, 2 * h + e] * sc.scale_log2 - lse)
            store_tile(tiles.p + buffer, acc.s, seat)
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
            store_tile(tiles.p + buffer, acc.s, seat)
        store_tile(tiles.ds + buffer, acc.dp, seat)
        hp.fence_proxy_async_shared_cta()
        ptx.cp_async_wait_group_0()  # the next step's rows
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)  # every warpgroup's P and dS, the next rows
        if seat.wg < VALUE_WGS:
            gemms.issue_dkv(acc.dv, hp.descriptor_add(descs.do_mn, do_at),
                            hp.descriptor_add(descs.p_mn, buffer))
        gemms.issue_dq(acc.dq, hp.descriptor_add(descs.ds_k, buffer), descs.k_mn)
        gemms.issue_dkv(acc.dk, hp.descriptor_add(descs.q_mn, q_at),
                        hp.descriptor_add(descs.ds_mn, buffer))
        hp.wgmma_wait_group_1()  # dVᵀ and dQ done; dKᵀ may still run
        gemms.fence_dq(acc.dq)
        add_dq(acc.dq, ws, step.row, seat, step.counter_at, step.turn, sc.deterministic)
        hp.wgmma_wait_group_0()
        gemms.fence_dkv(acc.dk)
        gemms.fence_dkv(acc.dv)
        ring.release(bars, i, seat.lane)

    return RowsConsumerSteps(consume_step)


def make_rows_consumer(config: WsBackwardConfig, walk_steps) -> RowsConsumer:
    """A consumer warpgroup of the unswapped tile: its registers and wgmma descriptors, then the walk
    (``walk_steps``: ``backward_ws.make_consumer_walk``'s over ``make_rows_consumer_steps``); dKᵀ and
    dVᵀ stay in registers throughout."""
    BM, BN = config.block_m, config.block_n
    D_N = BN // 8  # n-tiles of dKᵀ and dVᵀ (the block's keys)
    S_N = KEYS // 8

    @cuda.jit(device=True, forceinline=True)
    def consume(tiles, bars, kv_bar, blk, seat, sc, ws, heads_q, group, counters_per_head):
        """Every step of the walk for this warpgroup; returns dKᵀ and dVᵀ (registers)."""
        acc = RowsAccumulators(cuda.local.array((S_N, 4), float32), cuda.local.array((S_N, 4), float32),
                               cuda.local.array((D_N, 4), float32), cuda.local.array((D_N, 4), float32),
                               cuda.local.array((DQ_N, 4), float32))
        for j in range(D_N):
            for e in range(4):
                acc.dk[j, e] = 0.0
                acc.dv[j, e] = 0.0
        keys_at = seat.wg * (KEYS * 128)  # this warpgroup's 32 key rows
        cols_at = seat.wg * (BM * 128)  # its 64-column block of Q and dO (dO: warpgroups 0, 1)
        descs = RowsDescriptors(hp.smem_descriptor_k_sw128(tiles.q), hp.smem_descriptor_k_sw128(tiles.do),
                                hp.smem_descriptor_k_sw128(tiles.k + keys_at),
                                hp.smem_descriptor_k_sw128(tiles.v + keys_at),
                                hp.smem_descriptor_mn_sw128(tiles.q + cols_at, BM * 128),
                                hp.smem_descriptor_mn_sw128(tiles.do + cols_at, BM * 128),
                                hp.smem_descriptor_mn_sw128(tiles.p, BM * 128),
                                hp.smem_descriptor_mn_sw128(tiles.ds, BM * 128),
                                hp.smem_descriptor_k_sw128(tiles.ds),
                                hp.smem_descriptor_mn_sw128(tiles.k + seat.wg * (BN * 128), BN * 128))
        walk_steps(acc, RowsIo(descs, tiles, bars, blk, sc, ws), kv_bar, seat, heads_q, group,
                   counters_per_head)
        return acc

    return RowsConsumer(consume)


def make_rows_epilogue(config: WsBackwardConfig, bf16: bool) -> RowsEpilogue:
    """A consumer warp's end of the CTA: its warpgroup's dKᵀ (times the softmax scale) and dVᵀ stored
    transposed, 16-bit, into the K and V tiles, then 8 key rows of each written out with 16-byte
    stores, none past seqlen_k."""
    D, DV, BN = config.head_dim, config.value_dim, config.block_n
    CONSUMER_THREADS = config.consumers * WARPGROUP
    D_N = BN // 8
    VALUE_WGS = DV // WARPGROUP_ROWS
    STORE_ROWS = BN // (config.consumers * 4)  # key rows each consumer warp writes out
    BF16 = bf16

    @cuda.jit(device=True, forceinline=True)
    def store_dkv(acc, tiles, blk, seat, dk, dv, dk_strides, dv_strides, scale, seqlen_k):
        """dK · scale and dV, 16-bit, through the K and V tiles (every GEMM that reads them is done:
        a barrier of the consumers first, and another once the tiles are whole)."""
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        col0 = seat.wg * WARPGROUP_ROWS + seat.warp * 16  # the warp's 16 head-dim columns
        store_transposed_fragment(tiles.k, acc.dk, D_N, BN, col0, seat.lane, BF16, 128, scale)
        if seat.wg < VALUE_WGS:
            store_transposed_fragment(tiles.v, acc.dv, D_N, BN, col0, seat.lane, BF16, 128, float32(1.0))
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
