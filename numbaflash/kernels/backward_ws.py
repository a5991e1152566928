"""FlashAttention backward for Hopper (sm_90a): TMA + mbarrier + wgmma with warp specialisation
(FlashAttention-3's design, our own code).

The main kernel of the backward (the prepare and dQ kernels are the mma.sync backward's, for the
equivalent ``BackwardConfig``: ``WsBackwardConfig.dq_config``). One CTA per block of ``block_n``
keys of one (batch, KV head), in ``blocks.key_block_of``'s launch order; it keeps that block's dK
and dV in registers while it walks every query block of every query head of its group that sees
the block (GQA sums there), as the mma.sync kernel does:

* **Producer** (one thread of warpgroup 0, ``setmaxnreg.dec`` to 24): TMA loads K and V of the
  block once, then per query block Q and dO (tensor maps) into the next stage of a ring of
  ``stages``, once the consumers have released it.
* **Consumers** (two warpgroups of 64 keys each, ``setmaxnreg.inc`` to 240), per query block:

      Sᵀ  = K Qᵀ       wgmma SS m64n{block_m}: keys x queries, so that a warp's rows are its keys
      dPᵀ = V dOᵀ      wgmma SS, issued with Sᵀ
      Pᵀ  = exp2(Sᵀ·scale·log2e − LSE₂), masked;  dSᵀ = Pᵀ ∘ (dPᵀ − D)   (registers; Pᵀ
                       while dPᵀ runs where ``WsBackwardConfig.early_p``, else after it)
      dV += Pᵀ dO      wgmma RS: Pᵀ from registers (the accumulator is the A layout), dO MN-major
      dQ  = dS K       wgmma SS over the block's keys: dSᵀ stored to shared memory by both
                       warpgroups (a named barrier), read MN-major as dS; the warpgroups split dQ
                       by query rows or head-dim columns (``WsBackwardConfig.dq_split``), or, with
                       80 query rows (not a wgmma M), each computes dQᵀ = Kᵀ dSᵀ for 64 columns
      dK += dSᵀ Q      wgmma RS, issued after dQ so that it runs while dQ is added

  The query rows' LSE (log2 units) and D come from the workspace by the consumers' own cp.async,
  one step ahead, into two buffers taken by step parity: written after the barrier that ends
  the reads of the step before, read after the dSᵀ barrier of the step that wrote them. (Bulk
  copies by the producer, handed over by the ring's mbarriers, are as correct, but
  compute-sanitizer's racecheck does not follow that hand-over: it reported every row.)

  dQ is added into the float32 accumulator in the mma.sync kernel's fragment order with
  ``red.global.add.v4.f32`` (in key-block turns with ``deterministic``), then the stage is
  released. dSᵀ has two buffers, so one warpgroup's next dSᵀ never overwrites the one the other
  is still reading.
* **Epilogue**: dK (times the softmax scale) and dV, 16-bit, staged in the K and V tiles and
  stored with 16-byte stores, none past seqlen_k.

**Split GQA groups.** Where the grid is small (``operations.launch_backward.backward_group_splits``
> 1: fewer than two waves of CTAs, never in deterministic mode) the call runs the kernel's split
build (``group_split``, ``KernelSpec.group_split``), in which each group's query heads are split
over ``splits`` CTAs per key block (the kernel argument ``splits``); the other builds walk the
whole group in one CTA, as above, and hold no split code. Each split CTA adds its dK and dV into
the key block's float32 sums in the workspace (``red.global.add.v4.f32``, fragment order) and
takes a ticket; the one that takes the last reads the sums back and runs the epilogue
(``Epilogue.gather_split``).

Ragged lengths need no special path: TMA zero-fills rows past the end of Q, dO, K and V; the
workspace's rows past seqlen_q have LSE₂ = +inf (P = 0) and D = 0; keys past seqlen_k and, causal,
after a query's diagonal are masked. ``softcap`` and ``window`` are the mma.sync kernel's variants
(the tanh's derivative in dSᵀ; the walk over the window's query blocks and band masks).

The factory builds the kernel from named pieces, each a factory returning its steps as a named
tuple (as ``forward_ws`` does): the rings (``make_rings``), the walk every role shares
(``make_walk``) and where a CTA works
(``make_placement``), the producer (``make_producer``), one step of a consumer (``make_consumer_steps``:
GEMM issue, masks, the gradient of the scores, dSᵀ and dQ), the consumer's walk
(``make_consumer``) and the dK / dV epilogue (``make_epilogue``, with a split group's sums).
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint32

from .. import ptx
from ..ptx import hopper as hp
from . import params as declarations
from .backward_ws_rows import make_rows_consumer, make_rows_consumer_steps, make_rows_epilogue
from .blocks import (
    Band,
    band_kv_tiles,
    band_needs_mask,
    band_query_blocks,
    key_block_of,
    mask_band_transposed,
    mask_transposed,
)
from .common import FULL_MASK, warp_uniform
from .epilogue import store_rows_global
from .forward_ws import make_tile_loads
from .fragments import store_fragment_rows
from .ring import RingBarriers, make_ring
from .shapes import WARPGROUP_ROWS, WsBackwardConfig
from .smem import global_rows, swizzled_offset
from .softmax import cap_scores, pack_16bit
from .wgmma_gemms import make_backward_gemms

# Tensor maps of one call: 4-D (batch, seqlen, heads, head_dim) maps of q, k, v and dout.
Maps = namedtuple("Maps", ["q", "k", "v", "do"])
# Where one CTA works: its key block's first key, (batch, KV head), its split's first query head
# past the group's first (0 in the builds that do not split: ``make_placement``), the query blocks
# it walks per query head (m_first .. m_blocks - 1, walked downwards), the steps of the walk (its
# query heads x blocks),
# the causal diagonal, the window (a blocks.Band) and the workspace's rows per (batch, head).
Block = namedtuple("Block", ["n0", "n_block", "batch", "kv_head", "split_head", "m_first", "m_blocks",
                             "steps", "diag", "band", "rows", "seqlen_q"])
# Shared tiles (32-bit shared addresses): K, V, ring stage 0 of Q and dO, rows buffer 0 of LSE and
# D, dSᵀ buffer 0 (the unswapped tile's: its dS and P buffers, and its staged dQ).
Tiles = namedtuple("Tiles", ["k", "v", "q", "do", "lse", "delta", "ds", "p", "dq"])
# A consumer warp's seat: its warpgroup, warp in it, lane, thread among the consumers (0 .. 255).
Seat = namedtuple("Seat", ["wg", "warp", "lane", "thread"])
# A consumer warp's registers: Sᵀ (then Pᵀ), dPᵀ (then dSᵀ), Pᵀ and dSᵀ as 16-bit A fragments,
# dV, dK and this step's dQ.
Accumulators = namedtuple("Accumulators", ["s", "dp", "p", "ds", "dv", "dk", "dq"])
# wgmma descriptors: this warpgroup's K and V rows (K-major), ring stage 0's Q and dO (K-major, and
# MN-major), dSᵀ buffer 0 as this warpgroup's A of dQ, and this warpgroup's B of dQ (K, MN-major).
Descriptors = namedtuple("Descriptors", ["k", "v", "q", "do", "q_mn", "do_mn", "ds", "k_mn"])
# The scalars a consumer reads: the exponent factor, softmax scale / softcap, deterministic mode.
Scalars = namedtuple("Scalars", ["scale_log2", "cap_scale", "deterministic"])
# The float32 workspace: the byte addresses of the dQ accumulator and the turn counters, the LSE₂
# and D rows (arrays: their addresses are taken where ``stage_rows`` copies, from the kernel's
# parameters, so that no register holds them through the step).
Workspace = namedtuple("Workspace", ["dq", "counters", "lse2", "delta"])
# What a consumer reads besides its registers: descriptors, tiles, the ring's barriers, its Block,
# the Scalars and the Workspace.
Io = namedtuple("Io", ["descs", "tiles", "bars", "blk", "sc", "ws"])
# One step of the walk: its ring use, first query row, workspace row (bh * rows + m0), turn
# counter's address and the count it must reach (deterministic mode), the next step's workspace
# row (-1 after the last step).
Step = namedtuple("Step", ["i", "m0", "row", "counter_at", "turn", "next_row"])

# The rings of one kernel (``ring.RingSteps`` each): the ``stages`` stages of Q and dO, one per
# step of the walk, and the one-shot barrier of K and V.
Rings = namedtuple("Rings", ["step", "kv"])
# Where a CTA of the launch order works (``make_placement``): its key block, (batch, KV head), its
# split's first query head past the group's first (0 where the group is not split) and how many
# query heads it walks.
Place = namedtuple("Place", ["n_block", "batch", "kv_head", "split_head", "heads"])
# A GQA group split over CTAs (``Epilogue.gather_split``): the byte addresses of this key block's
# dK and dV sums and of its ticket, and the CTAs the group is split over.
SplitSums = namedtuple("SplitSums", ["dkv", "ticket", "splits"])

# The pieces' steps (each factory below returns one of these).
Placement = namedtuple("Placement", ["place", "split_sums"])
# The kernel's arguments (``params.WS_BACKWARD``, by name) and a split build's last three
# (``params.GROUP_SPLIT``).
WsBackwardArgs = namedtuple("WsBackwardArgs", declarations.names_of(declarations.WS_BACKWARD))
GroupSplit = namedtuple("GroupSplit", declarations.names_of(declarations.GROUP_SPLIT))
Walk = namedtuple("Walk", ["next_block", "workspace_row", "turn_of"])
Producer = namedtuple("Producer", ["produce_steps"])
DqWriter = namedtuple("DqWriter", ["dq_barriers", "write_dq_steps"])
RowStaging = namedtuple("RowStaging", ["stage_rows"])
DqTurns = namedtuple("DqTurns", ["wait_turn", "pass_turn"])
ConsumerSteps = namedtuple("ConsumerSteps", ["stage_rows", "consume_step"])
ConsumerWalk = namedtuple("ConsumerWalk", ["walk_steps"])
Consumer = namedtuple("Consumer", ["consume"])
Epilogue = namedtuple("Epilogue", ["store_dkv", "gather_split"])

WARPGROUP = 128  # threads
DS_BARRIER = 1  # named barrier of the consumer warpgroups (bar.sync id; 0 is syncthreads)
ONE = uint32(1)


def make_rings(config: WsBackwardConfig) -> Rings:
    """The steps of the kernel's rings: ``stages`` stages of Q and dO, and K and V's one load."""
    return Rings(make_ring(config.stages, config.layout.q_stage), make_ring(1))


def dq_n_tiles(config: WsBackwardConfig) -> int:
    """The 8-column n-tiles of a consumer warpgroup's dQ: every column with ``dq_split`` "m" (the
    warpgroups split the query rows), else its share of the head-dim columns."""
    if config.dq_split == "t":  # dQᵀ: the block's queries are the N
        return config.block_m // 8
    n_tiles = config.head_dim // 8
    return n_tiles if config.dq_split == "m" else n_tiles // config.consumers


# ---------------------------------------------------------------------------------- placement

def make_placement(config: WsBackwardConfig, group_split: bool) -> Placement:
    """Where a CTA works: its key block, (batch, KV head) and query heads, from its place in the
    launch order; and, in a GQA-split build (``group_split``: each group split over ``splits``
    CTAs), where its key block's dK and dV sums and ticket are (``abi``'s workspace: per key block
    of every (batch, KV head), 2 * block_n * head_dim float32, then one int32 ticket each)."""
    BLOCK_SUMS = 2 * config.block_n * config.head_dim * 4  # bytes of a key block's dK and dV sums

    @cuda.jit(device=True, forceinline=True)
    def place_group(cta, key_blocks, pairs, tail_pairs, heads_kv, group, splits):
        """The CTA's ``Place`` in a build that does not split: ``key_block_of``'s (key block, pair)
        over pairs batch * heads_kv + kv_head, the group's every query head (``splits`` unused: the
        kernel's SASS is the one from before the split, instruction for instruction)."""
        n_block, pair = key_block_of(cta, key_blocks, pairs, tail_pairs)
        kv_head = int64(uint32(pair) % uint32(heads_kv))
        return Place(n_block, int64(uint32(pair) // uint32(heads_kv)), kv_head, int64(0), group)

    @cuda.jit(device=True, forceinline=True)
    def place_split(cta, key_blocks, pairs, tail_pairs, heads_kv, group, splits):
        """The CTA's ``Place`` in a split build: ``key_block_of``'s (key block, pair) over ``pairs``
        pairs (batch * heads_kv + kv_head) * splits + split; split s of a group walks its group //
        splits query heads from kv_head * group + s * (group // splits). 32-bit divisions (each
        result narrowed: Numba widens uint32 arithmetic to 64 bits, and a 64-bit division is a
        called subroutine)."""
        n_block, pair = key_block_of(cta, key_blocks, pairs, tail_pairs)
        kv_pair = uint32(uint32(pair) // uint32(splits))
        split = uint32(uint32(pair) - kv_pair * uint32(splits))
        heads = uint32(uint32(group) // uint32(splits))
        kv_head = uint32(kv_pair % uint32(heads_kv))
        return Place(n_block, int64(uint32(kv_pair // uint32(heads_kv))), int64(kv_head),
                     int64(split * heads), int64(heads))

    @cuda.jit(device=True, forceinline=True)
    def split_sums(split, pl, key_blocks, heads_kv):
        """The ``SplitSums`` of the key block of ``pl`` (a Place); ``split`` a GroupSplit."""
        kb = (pl.batch * heads_kv + pl.kv_head) * key_blocks + pl.n_block
        return SplitSums(ptx.global_address_f32(split.dkv_acc) + kb * BLOCK_SUMS,
                         ptx.global_address_i32(split.tickets) + kb * 4, split.splits)

    return Placement(place_split if group_split else place_group, split_sums)


# ---------------------------------------------------------------------------------- the walk

def make_walk(config: WsBackwardConfig, window: bool = False) -> Walk:
    """The walk every role shares: each (query head of the group, query block) step of a CTA, the
    query blocks walked downwards, where a step's rows sit in the workspace, and the key block's
    turn at a query block's dQ in deterministic mode (``window``: a window build's)."""
    BM, BN = config.block_m, config.block_n
    WINDOW = window

    @cuda.jit(device=True, forceinline=True)
    def next_block(head, m_block, blk):
        """The step after (head, m_block): the next query block down, else the next head's top."""
        m1 = m_block - 1
        head1 = head
        if m1 < blk.m_first:
            head1 = head + 1
            m1 = blk.m_blocks - 1
        return head1, m1

    @cuda.jit(device=True, forceinline=True)
    def workspace_row(blk, heads_q, head, m_block):
        """The workspace row (LSE₂, D, dQ accumulator) of query block ``m_block``'s first query of
        query head ``head`` of the block's batch."""
        return (blk.batch * heads_q + head) * blk.rows + m_block * BM

    @cuda.jit(device=True, forceinline=True)
    def turn_of(blk, m0):
        """The count the turn counter of the query block from row ``m0`` must reach before this
        key block adds its dQ: the key blocks before it (in a window, those that see the block:
        they are consecutive)."""
        turn = blk.n_block
        if WINDOW:
            turn = blk.n_block - band_kv_tiles(m0, min(BM, blk.seqlen_q - m0), BN, blk.band)[0]
        return turn

    return Walk(next_block, workspace_row, turn_of)


# ---------------------------------------------------------------------------------- producer

def make_producer(config: WsBackwardConfig, rings: Rings, walk: Walk) -> Producer:
    """The producer thread's ring loads: Q and dO of every step of the walk, each into the next
    stage of the ring once the consumers have released it (K and V, loaded once, are the
    kernel's)."""
    BM = config.block_m
    STEP_BYTES = config.step_bytes
    DO_STAGE = config.layout.do_stage
    SAME_DIMS = config.value_dim == config.head_dim  # dO's stages are Q's: the ring's offsets
    ring = rings.step
    load_tile = make_tile_loads(config)
    load_do_tile = make_tile_loads(config, config.value_dim)
    next_block = walk.next_block

    @cuda.jit(device=True, forceinline=True)
    def produce_steps(maps, bars, tiles, blk, group):
        """The ring's loads: every step of the walk, each into the next stage once it is free."""
        head = blk.kv_head * group + blk.split_head
        m_block = blk.m_blocks - 1
        for step in range(blk.steps):
            i = uint32(step)
            s = ring.slot(i)
            ring.wait_empty(bars, i)
            full = ring.full(bars, s)
            ring.arm(bars, s, STEP_BYTES)
            m0 = m_block * BM
            load_tile(tiles.q + ring.offset(s), maps.q, full, m0, head, blk.batch, BM)
            do_at = ring.offset(s) if SAME_DIMS else s * uint32(DO_STAGE)
            load_do_tile(tiles.do + do_at, maps.do, full, m0, head, blk.batch, BM)
            head, m_block = next_block(head, m_block, blk)

    return Producer(produce_steps)


def make_dq_writer(config: WsBackwardConfig, walk: Walk) -> DqWriter:
    """The unswapped tile's dQ: one thread of the producer warpgroup adds each step's staged dQ (the
    consumers' ``tiles.dq``, in ``dq_config``'s order: the query block's accumulator rows are one
    contiguous range) into the workspace with a bulk reduce, in deterministic mode in its key block's turn.
    The buffer is a one-stage ring (``ring.make_ring``) whose roles are the other way round: the
    consumer warps fill it (``wait_empty``, then one arrival a warp on the full barrier) and this
    thread drains it (``wait_full``, the reduce's reads, then ``release``). Consumer thread 0 hands
    over the step's turn in the word after the staged dQ: the turn of a window build (a division)
    spilled in this thread's 24 registers."""
    BM, D = config.block_m, config.head_dim
    DQ_BYTES = BM * D * 4
    STAGES = config.stages
    dq_ring = make_ring(1)
    next_block, workspace_row = walk.next_block, walk.workspace_row

    @cuda.jit(device=True, forceinline=True)
    def dq_barriers(bars):
        """The dQ buffer's full and empty mbarriers, after the step ring's (``bars``)."""
        return RingBarriers(bars.empty + uint32(8 * STAGES), bars.empty + uint32(8 * STAGES + 8))

    @cuda.jit(device=True, forceinline=True)
    def write_dq_steps(tiles, bars, blk, ws, heads_q, group, counters_per_head, deterministic):
        """Every step's dQ, once the consumers have staged it."""
        dq_bars = dq_barriers(bars)
        head = blk.kv_head * group + blk.split_head
        m_block = blk.m_blocks - 1
        for step in range(blk.steps):
            i = uint32(step)
            dq_ring.wait_full(dq_bars, i)
            at = ws.dq + workspace_row(blk, heads_q, head, m_block) * (D * 4)
            if deterministic:  # after the key blocks before this one; complete before passing on
                counter_at = ws.counters + ((blk.batch * heads_q + head) * counters_per_head + m_block) * 4
                turn = int32(ptx.ld_shared_b32(tiles.dq + DQ_BYTES))  # the consumers' (``Walk.turn_of``)
                while ptx.ld_acquire_gpu_s32(counter_at) != turn:
                    pass
                hp.bulk_reduce_add_f32(at, tiles.dq, DQ_BYTES)
                hp.tma_store_commit_group()
                hp.tma_store_wait_group_0()
                cuda.threadfence()
                ptx.red_release_gpu_add_s32(counter_at, int32(1))
            else:
                hp.bulk_reduce_add_f32(at, tiles.dq, DQ_BYTES)
                hp.tma_store_commit_group()
                hp.tma_store_wait_group_read_0()
            dq_ring.release(dq_bars, i, 0)
            head, m_block = next_block(head, m_block, blk)
        hp.tma_store_wait_group_0()

    return DqWriter(dq_barriers, write_dq_steps)


# ---------------------------------------------------------------------------------- consumer steps

def make_dq_turns(config: WsBackwardConfig) -> DqTurns:
    """Deterministic mode's turns of the swapped tile (the unswapped tile's dQ writer takes its own,
    ``make_dq_writer``): a query block's key blocks add their dQ one after the other, in the order
    of its turn counter."""
    CONSUMER_THREADS = config.consumers * WARPGROUP

    @cuda.jit(device=True, forceinline=True)
    def wait_turn(seat, counter_at, turn):
        """Every consumer thread waits until the counter at ``counter_at`` reaches ``turn`` (the key
        blocks before this one have added theirs): thread 0 polls it, then a barrier."""
        if seat.thread == 0:
            while ptx.ld_acquire_gpu_s32(counter_at) != turn:
                pass
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)

    @cuda.jit(device=True, forceinline=True)
    def pass_turn(seat, counter_at):
        """Once every consumer thread's adds are fenced (a barrier), thread 0 passes the turn on."""
        cuda.threadfence()
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        if seat.thread == 0:
            ptx.red_release_gpu_add_s32(counter_at, int32(1))

    return DqTurns(wait_turn, pass_turn)


def make_row_staging(config: WsBackwardConfig) -> RowStaging:
    """The consumers' copies of a step's query rows (LSE₂ and D) into a rows buffer, shared by both
    tiles (``backward_ws_rows``)."""
    ROWS_BYTES = config.layout.rows_stage
    ROW_CHUNKS = ROWS_BYTES // 16  # 16-byte copies of a block's LSE (and of its D)

    @cuda.jit(device=True, forceinline=True)
    def stage_rows(tiles, ws, row, buffer, seat):
        """Copy the LSE₂ and D of workspace rows ``row`` .. ``row + block_m - 1`` into rows buffer
        ``buffer`` (cp.async, 16 bytes by each of the first block_m / 4 consumer threads from the
        LSE₂, by the next block_m / 4 from D; one commit group per thread, waited for before the
        consumers' next barrier)."""
        c = seat.thread
        at = buffer * uint32(ROWS_BYTES)
        if c < ROW_CHUNKS:
            ptx.cp_async_16_at(tiles.lse + at + c * uint32(16),
                               ptx.global_address_f32(ws.lse2) + row * 4 + c * 16)
        elif c < 2 * ROW_CHUNKS:
            e = c - uint32(ROW_CHUNKS)
            ptx.cp_async_16_at(tiles.delta + at + e * uint32(16),
                               ptx.global_address_f32(ws.delta) + row * 4 + e * 16)
        ptx.cp_async_commit_group()

    return RowStaging(stage_rows)


def make_consumer_steps(config: WsBackwardConfig, causal: bool, bf16: bool, rings: Rings,
                        window: bool = False, softcap: bool = False) -> ConsumerSteps:
    """One step of the walk for a consumer warpgroup: the five GEMMs of a query block, the masks,
    the gradient of the scores, dSᵀ through shared memory and dQ's adds; and the cp.async copies
    of a step's LSE₂ and D rows."""
    D, BM, BN = config.head_dim, config.block_m, config.block_n
    CONSUMER_THREADS = config.consumers * WARPGROUP
    lay = config.layout
    ROWS_BYTES = lay.rows_stage
    S_N = BM // 8  # n-tiles of Sᵀ and dPᵀ (queries)
    P_K = BM // 16  # k-steps of dV and dK
    DQ_N = dq_n_tiles(config)  # n-tiles of a warpgroup's dQ
    DQ_COLS = DQ_N * 8
    CAUSAL, WINDOW, SOFTCAP, BF16 = causal, window, softcap, bf16
    # the window and softcap builds keep the rows before their first GEMMs: staged late, their
    # extra live values spill there (window 6 LDL / 12 STL, causal softcap 8 / 3; sm_90a)
    LATE_ROWS = config.late_rows and not (window or softcap)
    EARLY_P = config.early_p and not softcap
    ring = rings.step
    gemms = make_backward_gemms(D, BM, BN, DQ_COLS, bf16, dq_transposed=config.dq_split == "t")

    stage_rows = make_row_staging(config).stage_rows
    wait_turn, pass_turn = make_dq_turns(config)

    @cuda.jit(device=True, forceinline=True)
    def mask_scores(acc_s, blk, m0, seat, seqlen_k):
        """Scores of keys past the last, causal after the diagonal, or outside the window: -inf
        (only on tiles that hold one: the warp's 16 keys x the block's queries)."""
        key0 = blk.n0 + seat.wg * WARPGROUP_ROWS + seat.warp * 16
        if WINDOW:
            if band_needs_mask(key0, 16, m0, BM, blk.band):
                mask_band_transposed(acc_s, S_N, key0, m0, seat.lane, blk.band)
        elif key0 + 16 > seqlen_k or (CAUSAL and key0 + 15 > m0 + blk.diag):
            mask_transposed(acc_s, S_N, key0, m0, seat.lane, seqlen_k, blk.diag, CAUSAL)

    @cuda.jit(device=True, forceinline=True)
    def exponentiate_scores(acc_s, lse_at, scale_log2):
        """Sᵀ -> Pᵀ = exp2(Sᵀ·scale − LSE₂) in place (``EARLY_P``: while dPᵀ's GEMM runs)."""
        for j in range(S_N):
            for e in range(2):
                lse = ptx.ld_shared_f32(lse_at + (8 * j + e) * 4)
                for r in range(2):
                    acc_s[j, 2 * r + e] = ptx.exp2(acc_s[j, 2 * r + e] * scale_log2 - lse)

    @cuda.jit(device=True, forceinline=True)
    def gradient_of_scores(acc, lse_at, delta_at, scale_log2):
        """Sᵀ -> Pᵀ and dPᵀ -> dSᵀ = Pᵀ ∘ (dPᵀ − D), each packed at once into the 16-bit A fragments
        of dV and dK (``acc.p``, ``acc.ds``: k-step kt holds n-tiles 2 kt and 2 kt + 1, the m16k16 A
        layout), so that no float32 copy outlives its k-step. Each column is a query, whose LSE₂
        and D sit in the step's rows buffer (``lse_at``, ``delta_at``: the lane's first column)."""
        acc_s, acc_dp = acc.s, acc.dp
        for kt in range(P_K):
            for half in range(2):
                j = 2 * kt + half
                for e in range(2):
                    lse = float32(0.0) if EARLY_P else ptx.ld_shared_f32(lse_at + (8 * j + e) * 4)
                    d = ptx.ld_shared_f32(delta_at + (8 * j + e) * 4)
                    for r in range(2):
                        s = acc_s[j, 2 * r + e]
                        if SOFTCAP:  # s = t = tanh(.): d(score)/d(QKᵀ·scale) = 1 - t² (see backward_mma)
                            # (dPᵀ − D)·(1 − t²) first, so that t's register is free before P is made
                            acc_dp[j, 2 * r + e] = ((acc_dp[j, 2 * r + e] - d)
                                                    * max(float32(1.0) - s * s, float32(0.0)))
                        p = s if EARLY_P else ptx.exp2(s * scale_log2 - lse)
                        acc_s[j, 2 * r + e] = p
                        if SOFTCAP:
                            acc_dp[j, 2 * r + e] = p * acc_dp[j, 2 * r + e]
                        else:
                            acc_dp[j, 2 * r + e] = p * (acc_dp[j, 2 * r + e] - d)
                for r in range(2):
                    acc.p[kt, 2 * half + r] = pack_16bit(acc_s[j, 2 * r], acc_s[j, 2 * r + 1], BF16)
                    acc.ds[kt, 2 * half + r] = pack_16bit(acc_dp[j, 2 * r], acc_dp[j, 2 * r + 1], BF16)

    @cuda.jit(device=True, forceinline=True)
    def store_ds(ds_tile, ds_frag, seat):
        """This warp's dSᵀ (16 keys x the block's queries; its A fragments, whose word 2 half + r
        of k-step kt is the pair of n-tile 2 kt + half, row half r) into the swizzled dSᵀ tile
        (``block_n`` key rows of 128-byte column blocks of 64 queries): one stmatrix.x4 a k-step,
        word i the 8x8 matrix i, whose row r lane 8 i + r addresses (key half i % 2, query half
        i // 2)."""
        regs = cuda.local.array(4, uint32)
        matrix = seat.lane // 8
        key = seat.wg * WARPGROUP_ROWS + seat.warp * 16 + (matrix % 2) * 8 + seat.lane % 8
        for kt in range(P_K):
            for i in range(4):
                regs[i] = ds_frag[kt, i]
            hp.stmatrix_x4(uint32(ds_tile + swizzled_offset(key, 2 * kt + matrix // 2, BN, 128)), regs)

    @cuda.jit(device=True, forceinline=True)
    def add_dq(acc_q, ws, row, seat, counter_at, turn, deterministic):
        """This step's dQ into the query block's accumulator by the threads' ``red.global.add.v4``
        (fragment order, four floats an n-tile); in deterministic mode once the key blocks before
        this one have added theirs (``turn``: the count this block's counter must reach)."""
        if deterministic:
            wait_turn(seat, counter_at, turn)
        dq_at = ws.dq + (row * D + 4 * seat.thread) * 4
        for j in range(DQ_N):
            ptx.red_global_add_v4_f32(dq_at + j * (CONSUMER_THREADS * 16), acc_q[j, 0], acc_q[j, 1],
                                      acc_q[j, 2], acc_q[j, 3])
        if deterministic:
            pass_turn(seat, counter_at)

    @cuda.jit(device=True, forceinline=True)
    def consume_step(acc, io, step, seat):
        """One query block for this warpgroup: the five GEMMs, the gradient of the scores, dQ's
        adds; the stage is released at the end."""
        descs, tiles, bars, blk = io.descs, io.tiles, io.bars, io.blk
        sc, ws = io.sc, io.ws
        i, m0, row = step.i, step.m0, step.row
        s = ring.slot(i)
        q_at = ring.offset(s)
        parity = i & ONE
        # the other rows buffer's last reads were before the previous step's barrier
        if not LATE_ROWS and step.next_row >= 0:
            stage_rows(tiles, ws, step.next_row, parity ^ ONE, seat)
        ring.wait_full(bars, i)
        gemms.issue_scores(acc.s, descs.k, hp.descriptor_add(descs.q, q_at))
        gemms.issue_scores(acc.dp, descs.v, hp.descriptor_add(descs.do, q_at))
        if LATE_ROWS and step.next_row >= 0:
            stage_rows(tiles, ws, step.next_row, parity ^ ONE, seat)
        hp.wgmma_wait_group_1()
        gemms.fence_scores(acc.s)
        if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
            cap_scores(acc.s, S_N, sc.cap_scale)
        mask_scores(acc.s, blk, m0, seat, blk.band.seqlen_k)
        first = uint32(8 * (seat.lane % 4))  # the lane's first column, in bytes of float32
        rows_at = parity * uint32(ROWS_BYTES) + first
        if EARLY_P:
            exponentiate_scores(acc.s, tiles.lse + rows_at, sc.scale_log2)
            # NVVM keeps the exponentials above the fence, and ptxas does not hoist dPᵀ's wait
            # above it; ptxas still sinks some exponentials below both (d64: 25-28 of 64)
            hp.fence_acq_rel_cta_after(acc.s[S_N - 1, 2], acc.s[S_N - 1, 3])
        hp.wgmma_wait_group_0()
        gemms.fence_scores(acc.dp)
        gradient_of_scores(acc, tiles.lse + rows_at, tiles.delta + rows_at, sc.scale_log2)
        gemms.issue_dkv(acc.dv, acc.p, hp.descriptor_add(descs.do_mn, q_at))
        buffer = parity * uint32(lay.ds_bytes)
        store_ds(tiles.ds + buffer, acc.ds, seat)
        hp.fence_proxy_async_shared_cta()
        ptx.cp_async_wait_group_0()  # the next step's rows
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)  # both warpgroups' dSᵀ, the next rows
        gemms.issue_dq(acc.dq, hp.descriptor_add(descs.ds, buffer), descs.k_mn)
        gemms.issue_dkv(acc.dk, acc.ds, hp.descriptor_add(descs.q_mn, q_at))
        hp.wgmma_wait_group_1()  # dV and dQ done; dK may still run
        gemms.fence_dq(acc.dq)
        add_dq(acc.dq, ws, row, seat, step.counter_at, step.turn, sc.deterministic)
        hp.wgmma_wait_group_0()
        gemms.fence_dkv(acc.dk)
        gemms.fence_dkv(acc.dv)
        ring.release(bars, i, seat.lane)

    return ConsumerSteps(stage_rows, consume_step)


# ---------------------------------------------------------------------------------- consumer

def make_consumer_walk(config: WsBackwardConfig, rings: Rings, walk: Walk, stage_rows,
                       consume_step) -> ConsumerWalk:
    """A consumer warpgroup's walk, shared by both tiles: the first step's rows, K and V's wait,
    then every step (``consume_step(acc, io, Step, seat)``) with its workspace row, turn counter
    (``Walk.turn_of``) and the next step's rows."""
    BM = config.block_m
    CONSUMER_THREADS = config.consumers * WARPGROUP
    kv_once = rings.kv
    next_block, workspace_row, turn_of = walk

    @cuda.jit(device=True, forceinline=True)
    def walk_steps(acc, io, kv_bar, seat, heads_q, group, counters_per_head):
        """Every step of the walk for this warpgroup (``io``: an Io)."""
        blk, ws = io.blk, io.ws
        head = blk.kv_head * group + blk.split_head
        m_block = blk.m_blocks - 1
        if blk.steps > 0:  # the first step's rows, in buffer 0
            stage_rows(io.tiles, ws, workspace_row(blk, heads_q, head, m_block), uint32(0), seat)
            ptx.cp_async_wait_group_0()
            hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        kv_once.wait_full(kv_bar, uint32(0))
        for step in range(blk.steps):
            m0 = m_block * BM
            bh = blk.batch * heads_q + head
            turn = turn_of(blk, m0)
            counter_at = ws.counters + (bh * counters_per_head + m_block) * 4
            head1, m_block1 = next_block(head, m_block, blk)
            next_row = int64(-1)
            if step + 1 < blk.steps:
                next_row = workspace_row(blk, heads_q, head1, m_block1)
            row = workspace_row(blk, heads_q, head, m_block)
            consume_step(acc, io, Step(uint32(step), m0, row, counter_at, turn, next_row), seat)
            head, m_block = head1, m_block1

    return ConsumerWalk(walk_steps)


def make_consumer(config: WsBackwardConfig, causal: bool, bf16: bool, rings: Rings, walk: Walk,
                  window: bool = False, softcap: bool = False) -> Consumer:
    """A consumer warpgroup of the swapped tile: its registers and wgmma descriptors, then the walk
    (``make_consumer_walk`` over ``make_consumer_steps``); dK and dV stay in registers
    throughout."""
    D, BM, BN = config.head_dim, config.block_m, config.block_n
    S_N = BM // 8  # n-tiles of Sᵀ and dPᵀ (queries)
    P_K = BM // 16  # k-steps of dV and dK
    D_N = D // 8  # n-tiles of dK and dV
    SPLIT_M = config.dq_split == "m"
    DQ_T = config.dq_split == "t"
    DQ_N = dq_n_tiles(config)  # n-tiles of a warpgroup's dQ
    DQ_COLS = DQ_N * 8
    stage_rows, consume_step = make_consumer_steps(config, causal, bf16, rings, window, softcap)
    walk_steps = make_consumer_walk(config, rings, walk, stage_rows, consume_step).walk_steps

    @cuda.jit(device=True, forceinline=True)
    def consume(tiles, bars, kv_bar, blk, seat, sc, ws, heads_q, group, counters_per_head):
        """Every step of the walk for this warpgroup; returns dK and dV (registers)."""
        acc = Accumulators(cuda.local.array((S_N, 4), float32), cuda.local.array((S_N, 4), float32),
                           cuda.local.array((P_K, 4), uint32), cuda.local.array((P_K, 4), uint32),
                           cuda.local.array((D_N, 4), float32), cuda.local.array((D_N, 4), float32),
                           cuda.local.array((DQ_N, 4), float32))
        for j in range(D_N):
            for e in range(4):
                acc.dv[j, e] = 0.0
                acc.dk[j, e] = 0.0
        rows_at = seat.wg * WARPGROUP_ROWS * 128  # this warpgroup's 64 key rows
        if SPLIT_M:  # dQ rows 64 wg ..: the dSᵀ tile's column block wg; every K column
            ds_at = seat.wg * (BN * 128)
            k_at = 0
        elif DQ_T:  # dQᵀ rows (head-dim columns) 64 wg ..: K's column block wg
            ds_at = 0
            k_at = seat.wg * (BN * 128)
        else:  # dQ columns DQ_COLS wg ..: the whole dSᵀ tile; K's column blocks from DQ_COLS wg
            ds_at = 0
            k_at = seat.wg * (DQ_COLS // 64) * (BN * 128)
        descs = Descriptors(hp.smem_descriptor_k_sw128(tiles.k + rows_at),
                            hp.smem_descriptor_k_sw128(tiles.v + rows_at),
                            hp.smem_descriptor_k_sw128(tiles.q), hp.smem_descriptor_k_sw128(tiles.do),
                            hp.smem_descriptor_mn_sw128(tiles.q, BM * 128),
                            hp.smem_descriptor_mn_sw128(tiles.do, BM * 128),
                            hp.smem_descriptor_mn_sw128(tiles.ds + ds_at, BN * 128),
                            hp.smem_descriptor_mn_sw128(tiles.k + k_at, BN * 128))
        walk_steps(acc, Io(descs, tiles, bars, blk, sc, ws), kv_bar, seat, heads_q, group, counters_per_head)
        return acc

    return Consumer(consume)


# ---------------------------------------------------------------------------------- epilogue

def make_epilogue(config: WsBackwardConfig, bf16: bool) -> Epilogue:
    """A consumer warp's end of the CTA: its 16 rows of dK · scale and dV, 16-bit, staged in the K
    and V tiles and stored with 16-byte stores, none past seqlen_k (``store_dkv``). Where a GQA
    group is split over CTAs, each first adds its dK and dV into the key block's float32 sums, and
    only the last to finish reads them back and stores them (``gather_split``)."""
    D, BN = config.head_dim, config.block_n
    CONSUMER_THREADS = config.consumers * WARPGROUP
    D_N = D // 8  # n-tiles of dK and dV
    TILE_BYTES = CONSUMER_THREADS * 16  # an n-tile of the sums: four floats a consumer thread
    DV_AT = D_N * TILE_BYTES  # the dV sums' offset in a key block's (after dK's: block_n * D floats)
    CPR = D // 8  # 16-byte chunks of a K / V row
    STORE_ROWS = 16  # rows of dK and dV each warp stores: its own
    BF16 = bf16

    @cuda.jit(device=True, forceinline=True)
    def store_dkv(acc, tiles, blk, seat, dk, dv, dk_strides, dv_strides, scale, seqlen_k):
        """dK · scale and dV, 16-bit, through this warp's own 16 rows of the K and V tiles (every
        GEMM that reads them is done: a barrier of both warpgroups first)."""
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        row0 = seat.wg * WARPGROUP_ROWS + seat.warp * 16
        store_fragment_rows(tiles.k, acc.dk, D_N, BN, row0, 0, seat.lane, BF16, 128, scale)
        store_fragment_rows(tiles.v, acc.dv, D_N, BN, row0, 0, seat.lane, BF16, 128, float32(1.0))
        cuda.syncwarp(FULL_MASK)
        scratch = cuda.local.array(4, uint32)
        dk_rows = global_rows(dk, blk.batch * dk_strides[0] + blk.kv_head * dk_strides[2], dk_strides[1],
                              seqlen_k)
        dv_rows = global_rows(dv, blk.batch * dv_strides[0] + blk.kv_head * dv_strides[2], dv_strides[1],
                              seqlen_k)
        store_rows_global(dk_rows, blk.n0 + row0, tiles.k, BN, row0, STORE_ROWS, CPR, seat.lane, scratch, 128)
        store_rows_global(dv_rows, blk.n0 + row0, tiles.v, BN, row0, STORE_ROWS, CPR, seat.lane, scratch, 128)

    @cuda.jit(device=True, forceinline=True)
    def gather_split(acc, tiles, seat, sums):
        """This CTA's dK (unscaled) and dV added into the key block's float32 sums (``sums``: a
        SplitSums; fragment order, n-tile j of consumer thread t at 16 (j * 256 + t) bytes:
        coalesced ``red.global.add.v4.f32``), then a ticket: the CTA that takes the last of
        ``sums.splits`` (every other CTA's adds are then done and visible) reads the sums back into
        ``acc`` and returns True, so that it stores them; the others return False.

        Thread 0 takes the ticket once every consumer thread's adds are fenced (a barrier) and
        hands it over in the rows buffer, whose last reads were before the walk's last barrier."""
        at = sums.dkv + seat.thread * 16
        for j in range(D_N):
            ptx.red_global_add_v4_f32(at + j * TILE_BYTES, acc.dk[j, 0], acc.dk[j, 1], acc.dk[j, 2],
                                      acc.dk[j, 3])
            ptx.red_global_add_v4_f32(at + DV_AT + j * TILE_BYTES, acc.dv[j, 0], acc.dv[j, 1], acc.dv[j, 2],
                                      acc.dv[j, 3])
        cuda.threadfence()
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        if seat.thread == 0:
            ptx.st_shared_b32(tiles.lse, uint32(ptx.atom_add_acq_rel_gpu_s32(sums.ticket, int32(1))))
        hp.named_barrier_sync(DS_BARRIER, CONSUMER_THREADS)
        last = int64(ptx.ld_shared_b32(tiles.lse)) == sums.splits - 1
        if last:
            cuda.threadfence()
            scratch = cuda.local.array(4, float32)
            for j in range(D_N):
                ptx.ld_relaxed_gpu_v4_f32(scratch, at + j * TILE_BYTES)
                for e in range(4):
                    acc.dk[j, e] = scratch[e]
                ptx.ld_relaxed_gpu_v4_f32(scratch, at + DV_AT + j * TILE_BYTES)
                for e in range(4):
                    acc.dv[j, e] = scratch[e]
        return last

    return Epilogue(store_dkv, gather_split)


# ---------------------------------------------------------------------------------- kernel

def make_backward_ws_kernel(config: WsBackwardConfig, causal: bool, bf16: bool, window: bool = False,
                            softcap: bool = False, group_split: bool = False):
    """The main kernel (``params.WS_BACKWARD``): grid ceil(seqlen_k / block_n) * heads_kv * batch
    in one dimension (``blocks.key_block_of``: ``make_placement``), ``config.threads`` threads,
    ``config.shared_bytes`` of dynamic shared memory; jit it with ``launch_bounds=(config.threads,
    1)``. The kernel is the body's entry, generated from its declaration (``params.entry``).

    ``group_split``: the GQA-split build (``params.GROUP_SPLIT`` last: ``dkv_acc``, ``tickets``,
    zeroed before the launch, and ``splits``), launched where
    ``operations.launch_backward.backward_group_splits`` > 1: grid ceil(seqlen_k / block_n) *
    heads_kv * splits * batch, each group's query heads split over ``splits`` CTAs, which add
    their dK and dV into float32 sums; the last to finish stores them. The other builds have no
    split code (their SASS is the one before the split existed).

    ``window``: a sliding-window kernel (``causal`` must be False: the window's right edge 0 is
    causal masking); ``softcap``: scores capped by tanh (``cap_scale`` = softmax scale / softcap,
    ``scale_log2`` = softcap·log2(e)). Kernels without them never read those arguments."""
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    config.check()
    D, BM, BN, STAGES = config.head_dim, config.block_m, config.block_n, config.stages
    CONSUMER_WARPS = config.consumers * WARPGROUP // 32
    lay = config.layout
    KV_BYTES = BN * (D + config.value_dim) * 2  # K and V
    CAUSAL, WINDOW, GROUP_SPLIT = causal, window, group_split
    rings = make_rings(config)
    ring, kv_once = rings
    load_k_tile = make_tile_loads(config, row_bytes=config.k_row_bytes)
    load_v_tile = make_tile_loads(config, config.value_dim)
    BARRIER_WORDS = config.barrier_words
    lower_registers = getattr(hp, f"setmaxnreg_dec_{config.register_split[0]}")
    raise_registers = getattr(hp, f"setmaxnreg_inc_{config.register_split[1]}")
    placement = make_placement(config, group_split)
    walk = make_walk(config, window)
    BULK_DQ = not config.swapped  # the unswapped tile's dQ: staged, then a bulk reduce
    dq_barriers, write_dq_steps = make_dq_writer(config, walk)
    produce_steps = make_producer(config, rings, walk).produce_steps
    if config.swapped:
        consume = make_consumer(config, causal, bf16, rings, walk, window, softcap).consume
        store_dkv, gather_split = make_epilogue(config, bf16)
    else:  # FlashAttention-4's (192, 128) tile: S and dP by rows, 48 keys a warpgroup
        if group_split:
            raise ValueError(f"{config} has no GQA-split build (its tile is unswapped: WsBackwardConfig)")
        stage_rows = make_row_staging(config).stage_rows
        consume_step = make_rows_consumer_steps(config, causal, bf16, rings, stage_rows, dq_barriers, window,
                                                softcap).consume_step
        walk_steps = make_consumer_walk(config, rings, walk, stage_rows, consume_step).walk_steps
        consume = make_rows_consumer(config, walk_steps).consume
        store_dkv = make_rows_epilogue(config, bf16).store_dkv
        gather_split = None

    @cuda.jit(device=True, forceinline=True)
    def run_cta(a, split):
        """The kernel's body: ``a`` a WsBackwardArgs (``params.WS_BACKWARD``), ``split`` a
        GroupSplit (split builds) or an unused placeholder."""
        smem = cuda.shared.array(0, types.uint16)
        bar_words = cuda.shared.array(BARRIER_WORDS, types.uint64)
        tid = cuda.threadIdx.x
        seqlen_q, seqlen_k = a.seqlen_q, a.seqlen_k
        key_blocks = uint32((seqlen_k + BN - 1) // BN)
        pl = placement.place(cuda.blockIdx.x, key_blocks, uint32(cuda.gridDim.x) // key_blocks,
                             a.tail_pairs if CAUSAL or WINDOW else 0, a.heads_kv, a.group,
                             split.splits if GROUP_SPLIT else 1)
        n_block, batch, kv_head = pl.n_block, pl.batch, pl.kv_head
        n0 = int32(n_block * BN)  # 32-bit: a key index (no 64-bit high word held through the walk)
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag
        m_blocks = (seqlen_q + BM - 1) // BM
        m_first = int64(0)
        if CAUSAL:
            m_first = max(n0 - diag, 0) // BM  # the first query block that sees a key of the block
        # read by WINDOW kernels only; 32-bit (fewer registers): the window's edges clamped to the
        # rows and keys that exist (an unbounded side is 2^40), which sees the same keys
        band = Band(int32(seqlen_k), int32(max(diag - a.window_left, -seqlen_q)),
                    int32(min(diag + a.window_right, seqlen_k)))
        if WINDOW:
            m_first, m_blocks = band_query_blocks(n0, min(BN, seqlen_k - n0), BM, seqlen_q, band)
        if GROUP_SPLIT:  # a 32-bit count: the 64-bit one's high word, held through the walk, spilled
            # in the d128 window and 80-row causal split builds (8 LDL/STL each, sm_90a); the other
            # builds keep theirs (their SASS as measured)
            steps = int32(pl.heads * max(m_blocks - m_first, 0))
        else:
            steps = pl.heads * max(m_blocks - m_first, 0)
        blk = Block(n0, n_block, batch, kv_head, pl.split_head, m_first, m_blocks, steps, diag, band, a.rows,
                    seqlen_q)

        base = (ptx.shared_address_u16(smem) + 1023) & ~uint32(1023)  # swizzle atoms: 1024-aligned
        tiles = Tiles(base + lay.k, base + lay.v, base + lay.q, base + lay.do, base + lay.lse,
                      base + lay.delta, base + lay.ds, base + lay.p, base + lay.dq)
        b = ptx.shared_address_u64(bar_words)
        kv_bar = RingBarriers(b, b)
        bars = RingBarriers(b + 8, b + 8 + 8 * STAGES)
        if tid == 0:
            hp.mbarrier_init(kv_bar.full, 1)
            for s in range(STAGES):
                hp.mbarrier_init(ring.full(bars, s), 1)
                hp.mbarrier_init(ring.empty(bars, s), CONSUMER_WARPS)
            if BULK_DQ:  # filled by the consumer warps, drained by one thread
                dq_bars = dq_barriers(bars)
                hp.mbarrier_init(dq_bars.full, CONSUMER_WARPS)
                hp.mbarrier_init(dq_bars.empty, 1)
            hp.fence_mbarrier_init()
            hp.tma_prefetch_descriptor(a.map_q)
            hp.tma_prefetch_descriptor(a.map_k)
            hp.tma_prefetch_descriptor(a.map_v)
            hp.tma_prefetch_descriptor(a.map_do)
        cuda.syncthreads()  # the last CTA-wide barrier: the roles part here
        if tid < WARPGROUP:
            lower_registers()
            if tid == 0:
                maps = Maps(a.map_q, a.map_k, a.map_v, a.map_do)
                kv_once.arm(kv_bar, 0, KV_BYTES)
                load_k_tile(tiles.k, maps.k, kv_bar.full, n0, kv_head, batch, BN)
                load_v_tile(tiles.v, maps.v, kv_bar.full, n0, kv_head, batch, BN)
                produce_steps(maps, bars, tiles, blk, a.group)
            elif BULK_DQ and tid == 32:
                ws = Workspace(ptx.global_address_f32(a.dq_acc), ptx.global_address_i32(a.counters), a.lse2,
                               a.delta)
                write_dq_steps(tiles, bars, blk, ws, a.heads_q, a.group, a.rows // BM, a.deterministic)
        else:
            raise_registers()
            thread = uint32(tid - WARPGROUP)
            wg = uint32(warp_uniform(thread // uint32(WARPGROUP)))  # descriptors, rows: uniform registers
            seat = Seat(wg, (thread // uint32(32)) % uint32(4), thread % uint32(32), thread)
            sc = Scalars(a.scale_log2, a.cap_scale, a.deterministic)
            ws = Workspace(ptx.global_address_f32(a.dq_acc), ptx.global_address_i32(a.counters), a.lse2,
                           a.delta)
            acc = consume(tiles, bars, kv_bar, blk, seat, sc, ws, a.heads_q, a.group, a.rows // BM)
            last = True  # a split group's dK and dV: stored by the split that finishes last
            if GROUP_SPLIT:
                last = gather_split(acc, tiles, seat, placement.split_sums(split, pl, key_blocks, a.heads_kv))
            if last:
                store_dkv(acc, tiles, blk, seat, a.dk, a.dv, (a.dk_sb, a.dk_ss, a.dk_sh),
                          (a.dv_sb, a.dv_ss, a.dv_sh), a.scale, seqlen_k)

    names = declarations.names_of(declarations.WS_BACKWARD)
    flash_backward_ws = declarations.entry(
        "flash_backward_ws", declarations.WS_BACKWARD + declarations.GROUP_SPLIT if group_split
        else declarations.WS_BACKWARD,
        f"run_cta(WsBackwardArgs({', '.join(names)}), "
        f"{'GroupSplit(dkv_acc, tickets, splits)' if group_split else 'int32(0)'})",
        {"run_cta": run_cta, "WsBackwardArgs": WsBackwardArgs, "GroupSplit": GroupSplit, "int32": int32})

    mask_kind = "window" if window else "causal" if causal else "full"
    flash_backward_ws.__name__ = (f"flash_backward_ws_d{D}_m{BM}_n{BN}{config.tag}_{mask_kind}"
                                  f"{'_softcap' if softcap else ''}{'_split' if group_split else ''}_"
                                  f"{'bf16' if bf16 else 'f16'}")
    flash_backward_ws.launch_bounds = (config.threads, 1)
    return flash_backward_ws
