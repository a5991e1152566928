"""FlashAttention forward for Hopper (sm_90a): a TMA + mbarrier pipeline with warp
specialisation (FlashAttention-3's design, our own code).

A CTA has one producer warpgroup and two or three consumer warpgroups of 64 query rows each. It is
persistent: CTA c takes work units c, c + gridDim.x, ... of the (query block, head, batch)
list; a unit is one query block, or with causal masking a heavy and a light query block of
one head (equal cost per unit; see ``blocks.work_units``).

* **Producer** (warpgroup 0) gives its registers away (``setmaxnreg.dec`` to 24, or 32 beside
  three consumers); one thread
  issues every TMA load: the Q tile (``q_stages`` buffers, so the next tile's Q lands while
  this tile runs), then the K and V tiles of each visible KV block into rings of ``stages``
  shared-memory stages. Each stage has a "full" mbarrier (armed with the
  TMA byte count; the copy engine completes it) and an "empty" mbarrier (every consumer warp
  arrives when its wgmma has finished reading). Q has its own full/empty pair.
* **Consumers** (``setmaxnreg.inc`` to 240, or 160 when there are three) wait on "full", run

      S  = Q Kᵀ   wgmma SS m64n{block_n}k16: Q (K-major) and K (K-major) from shared memory
      O += P V    wgmma RS m64n{head_dim}k16: P (16-bit) from registers, V MN-major (no
                  transpose: a V tile as TMA lands it is the MN-major B operand)

  and release each stage on "empty" as soon as its GEMM has completed. The online softmax
  is the mma.sync kernel's (the wgmma accumulator has the same per-warp fragment layout).
* **Overlap**: S_{j+1} = Q K_{j+1}ᵀ and O += P_j V_j are issued
  together; the softmax of j+1 runs while PV_j is still in flight (``wgmma.wait_group 1``),
  and O is rescaled only after PV_j has completed.
* **Ping-pong** (``config.pingpong``): the consumer warpgroups take turns, round robin, issuing
  their GEMMs (named barriers), so that one's softmax overlaps the others' tensor-core work;
  their row maxes are adopted and O rescaled on every KV tile (no vote, no branch; not with a
  softcap), otherwise only when some row's max grew.
* **Epilogue**: O is normalised in registers, written with ``stmatrix`` into a swizzled
  shared tile and stored by TMA, whose tensor map clips rows past seqlen_q; LSE as before.
  With ``config.o_in_q`` (head dim 256, where shared memory holds no O tile) each consumer
  warpgroup stages its O rows over its own Q rows, and releases the Q buffer to the producer
  only once the TMA store has read them. With ``config.o_in_v`` (128 x 176 at head dim 128)
  O is staged at the start of the V ring once every warpgroup has finished reading V, and the
  producer loads the next tile's V only after the store has read O (the "O empty" barrier);
  Q stays free, so the next tile's Q lands during this tile's last softmax, PV and epilogue.

Tiles are column blocks in a TMA swizzle layout fixed by the head dim (``config.row_bytes``):
64 columns of 128-byte rows (128B swizzle) at head dims 64, 128 and 256; 32 columns of 64-byte
rows (64B swizzle) at 96, whose 192-byte rows do not split into 128-byte blocks. One TMA box
per block; the wgmma descriptors and the stmatrix addresses use the same swizzle.

Ragged lengths need no special path: TMA zero-fills rows past the end of Q, K and V, and the
last KV tile is masked. With 192-row tiles (three consumers), a warpgroup runs no GEMMs on the
KV tiles none of its rows can see, and only keeps the rings and turns in step (``skip_tiles``):
every tile when its rows all lie past seqlen_q, and with causal masking the block's last tile
(or two) past its own rows' diagonal, so that it reaches its epilogue and the next tile early.
Those causal kernels also end the query blocks at seqlen_q: the first block starts ``lead`` (0,
64 or 128) rows before row 0 (``WsConfig.first_block_lead``, a kernel parameter), whose Q rows
TMA zero-fills and whose warpgroups skip, so a ragged block is the lightest of a head.
Tensor maps are 4-D (batch, seqlen, heads, head_dim) over the
caller's strides, so GQA is a kv-head coordinate and strided inputs cost nothing.

The e4m3 build (``config.fp8``; ``operations.fp8_forward``) runs both products as m64nNk32 wgmma on
tiles of one byte an element. 8-bit operands are K-major only, so its V arrives transposed,
(batch, heads_kv, head_dim, keys), from ``fp8_prep``, with each 32 keys in the order a lane's S
accumulators hold them (``fp8_layout``): P goes from S to the PV product with no shuffle
(``softmax.pack_p_e4m3``). q's and k's descales multiply the exponent factor (or the softcap's), v's
and P's static scale (``softmax.P_SCALE_E4M3``) O at the end; O stays a 16-bit tile. Its packed
(varlen) build reads a sequence's V columns from ``fp8_prep.vt_start`` of its key offset, and the
descales of (sequence, KV head).

The factory builds the kernel from named pieces, each a factory returning its steps as a
named tuple (as ``wgmma_gemms.make_attention_gemms`` does): the rings (``ring.make_ring``), the
tile walk every role shares (``blocks.make_tile_walk``), the producer (``make_producer``), the
consumers' steps (``make_consumer_steps``: GEMM issue and the softmax), the epilogue
(``make_epilogue``) and the consumer's tile loop (``make_consumer``).
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint32

from .. import ptx
from ..ptx import hopper as hp
from . import params as declarations
from .blocks import (
    Band,
    PackedSequences,
    Problem,
    ScoreMask,
    band_needs_mask,
    block_first_row,
    make_tile_walk,
    mask_band,
    mask_if_needed,
    visible_kv_tiles,
)
from .common import FULL_MASK, NEG_INF, THRESHOLD, warp_uniform
from .epilogue import store_lse, store_rows_global
from .fp8_layout import Descales
from .fp8_prep import vt_start
from .ring import RingBarriers, make_ring
from .shapes import WARPGROUP_ROWS, WsConfig, block_columns
from .smem import global_rows, swizzle_phase
from .softmax import (
    P_SCALE_E4M3,
    adopt_row_max,
    cap_scores,
    exponentiate,
    exponentiate_e4m3,
    max_grew,
    pack_16bit,
    pack_p_e4m3,
    pack_p_fragments,
    row_sum_inverse,
    scale_o_rows,
    scaled_row_maxes,
    sink_logit,
    start_at_sink,
)
from .wgmma_gemms import make_attention_gemms

# The kernel's parameters of every build (``params.WS_FORWARD``), as the body (``run_cta``) takes them.
WsParams = namedtuple("WsParams", ["map_q", "map_k", "map_v", "map_o", "lse", "seqlen_q", "seqlen_k",
                                   "row_lead", "heads_q", "group", "batch_size", "scale_log2", "write_lse",
                                   "window_left", "window_right", "cap_scale"])
# Tensor maps of one call: 4-D (batch, seqlen, heads, head_dim) maps of q, k, v and o.
Maps = namedtuple("Maps", ["q", "k", "v", "o"])
# mbarriers of the Q, K and V rings (``ring.RingBarriers``), and of the O staging tile in the V
# ring (o_in_v): a one-stage ring with no full barrier (the consumers fill it themselves), whose
# empty barrier completes once a tile, when the TMA stores have read O (both fields name it).
Barriers = namedtuple("Barriers", ["q", "k", "v", "o"])
# Shared tiles (32-bit shared addresses, 1024-aligned): Q, K ring, V ring, O staging.
Tiles = namedtuple("Tiles", ["q", "k", "v", "o"])
# Per-warp online-softmax state: running row maxes (scaled, log2), this lane's part of the
# row sums, a tile's row maxes, and the O rescale factors of the last max change.
RowStats = namedtuple("RowStats", ["m_run", "l_run", "mx", "alpha"])
# A consumer warp's register arrays: the S accumulator, the O accumulator, P as 16-bit (or e4m3)
# A fragments of the PV wgmma, and 4 words to stage stmatrix operands.
Accumulators = namedtuple("Accumulators", ["s", "o", "p", "regs"])
# wgmma descriptors: this warpgroup's Q rows (K-major), K stage 0 (K-major) and V stage 0
# (MN-major: head-dim blocks block_n * row_bytes bytes apart; e4m3: transposed V, K-major); a
# tile's Q buffer is added to q.
Descriptors = namedtuple("Descriptors", ["q", "k", "v"])
# What a consumer reads and writes besides its registers, the exponent factor (softmax scale, or
# the softcap, times log2(e)), softmax scale / softcap (softcap kernels), for packed sequences
# (varlen kernels; else unused) the PackedSequences and the PackedOut, the learnable sink's
# float32 (heads_q,) logits (sink kernels; else unused), and the Descales (e4m3 kernels; else unused).
Io = namedtuple("Io", ["maps", "bars", "tiles", "problem", "lse", "write_lse", "scale_log2", "cap_scale",
                       "seqs", "out", "sink", "descales"])
# Where a varlen kernel's threads store O and the LSE: out (flat 16-bit), its row and head strides
# (elements), and the LSE's head stride (total_q).
PackedOut = namedtuple("PackedOut", ["o", "row_stride", "head_stride", "lse_head_stride"])
# How a warp turns a tile's raw scores into probabilities: where its rows sit (a ScoreMask), the
# sliding window (a Band; window kernels), the exponent factor and softmax scale / softcap.
Scoring = namedtuple("Scoring", ["at", "band", "scale_log2", "cap_scale"])
# One query tile in a consumer's hands: the tile, its first ring positions (KV, Q), the KV tiles
# the block reads (from tile kv_first) and the first n_own of them, which this warpgroup's rows
# see (the rest it skips), and its place (``blocks.Place``: its problem, first rows, batch).
TileWork = namedtuple("TileWork", ["tile", "kv0", "round_q", "n_tiles", "n_own", "kv_first", "place"])
# Where a consumer warp sits: consumer warpgroup (0 .. consumers - 1), warp in it, lane, thread in it.
Seat = namedtuple("Seat", ["wg", "warp", "lane", "thread"])
# A consumer warp's whole state, as its tile walk hands it from tile to tile.
ConsumerState = namedtuple("ConsumerState", ["acc", "stats", "descs", "io", "seat"])
# What the producer thread reads and writes.
ProducerState = namedtuple("ProducerState", ["maps", "bars", "tiles", "problem", "seqs"])

# The rings of one kernel (``ring.RingSteps`` each): Q buffers, the K and V stages (two rings
# in step: one count, one set of steps), the O tile staged in the V ring (o_in_v), and the V
# stages' offsets (``v``: ``kv`` itself, unless V's head dim differs and its stages are smaller).
Rings = namedtuple("Rings", ["q", "kv", "o", "v"])
# The pieces' steps (each factory below returns one of these).
Producer = namedtuple("Producer", ["produce"])
ConsumerSteps = namedtuple("ConsumerSteps", ["attend_overlapped", "skip_tiles", "release_q"])
Epilogue = namedtuple("Epilogue", ["finish_tile"])
Consumer = namedtuple("Consumer", ["consume"])

# Named barrier ids (0 is syncthreads): TURN_BARRIER + w is consumer w's ping-pong turn; the
# epilogue barriers of the consumer warpgroups follow them (epilogue_barrier).
TURN_BARRIER = 1
WARPGROUP = 128  # threads
WG_ROWS = WARPGROUP_ROWS  # query rows of a consumer warpgroup
ONE = uint32(1)
ZERO = uint32(0)


def epilogue_barrier(config: WsConfig) -> int:
    """The first epilogue named barrier (+ consumer warpgroup), after the turn barriers."""
    return TURN_BARRIER + config.consumers


def make_rings(config: WsConfig) -> Rings:
    """The steps of the kernel's rings: ``q_stages`` Q buffers, ``stages`` K and V stages, and
    the one O tile of o_in_v; V's offsets from a ring of its own where its stages are smaller
    than K's (``WsConfig.head_dim_v``)."""
    t = config.tile_bytes
    kv = make_ring(config.stages, t["k"])
    return Rings(make_ring(config.q_stages, t["q"]), kv, make_ring(1),
                 kv if t["v"] == t["k"] else make_ring(config.stages, t["v"]))


def make_tile_loads(config: WsConfig, columns: int = 0, row_bytes: int = 0):
    """``load_tile(dst, tmap, bar, row0, head, batch, rows)``: TMA the rows row0 .. row0 + rows
    of one (batch, head) into a swizzled tile, one box per column block; ``columns`` wide (0:
    the head dim; V's tiles: ``config.value_dim``); ``row_bytes`` a block's row (0: the config's
    ``row_bytes``; the unswapped backward's K: ``WsBackwardConfig.k_row_bytes``), which its
    tensor map's box and swizzle must match."""
    RB = row_bytes or config.row_bytes  # bytes per row of one swizzle block (128 or 64)
    BOX = block_columns(config, RB)  # head-dim columns of one block (64 or 32)
    D_CHUNKS = (columns or config.head_dim) // BOX  # blocks of a tile: one TMA box each

    @cuda.jit(device=True, forceinline=True)
    def load_tile(dst, tmap, bar, row0, head, batch, rows):
        """TMA the rows row0 .. row0 + rows of one (batch, head) into a swizzled tile: one
        ``BOX``-column box per block, ``rows * RB`` bytes apart."""
        for c in range(D_CHUNKS):
            hp.tma_load_4d(dst + c * rows * RB, tmap, bar, int32(c * BOX), int32(head), int32(row0),
                           int32(batch))

    return load_tile


def make_vt_loads(config: WsConfig):
    """e4m3: ``load_tile(dst, tmap, bar, key0, head, batch, rows)`` for V transposed: TMA the
    keys key0 .. key0 + rows (``rows`` = block_n) of one (batch, KV head) of the (batch, heads_kv,
    head_dim, keys) V as head-dim rows of ``vt_row_bytes`` keys, one box per block of keys,
    ``head_dim * vt_row_bytes`` bytes apart (the map is over (keys, head_dim, heads_kv, batch))."""
    VRB = config.vt_row_bytes
    D = config.value_dim
    BLOCKS = config.block_n // VRB

    @cuda.jit(device=True, forceinline=True)
    def load_tile(dst, tmap, bar, key0, head, batch, rows):
        for c in range(BLOCKS):
            hp.tma_load_4d(dst + c * D * VRB, tmap, bar, int32(key0 + c * VRB), int32(0), int32(head),
                           int32(batch))

    return load_tile


# ---------------------------------------------------------------------------------- producer

def make_producer(config: WsConfig, causal: bool, rings: Rings, window: bool = False,
                  varlen: bool = False) -> Producer:
    """The producer thread: for each tile of the walk, its Q, then K_j and V_j of each of its KV
    tiles (from the block's first, ``TileTurn.kv_first``), each into the next stage of its ring
    once the consumers have released it."""
    BM, BN = config.block_m, config.block_n
    Q_BYTES, K_BYTES, V_BYTES = (config.tile_bytes[name] for name in ("q", "k", "v"))
    O_IN_V = config.o_in_v
    q_ring, kv_ring, o_ring, v_ring = rings
    FP8_VARLEN = config.fp8 and varlen
    load_tile = make_tile_loads(config)
    if config.fp8:
        load_v_tile = make_vt_loads(config)  # V transposed
    elif config.value_dim == config.head_dim:
        load_v_tile = load_tile
    else:
        load_v_tile = make_tile_loads(config, config.value_dim)  # V's columns

    @cuda.jit(device=True, forceinline=True)
    def wait_o_stored(bars, round_q):
        """o_in_v: wait until the previous tile's O, staged in the V ring, has been read by its
        stores. Called once a tile, before anything that lets the consumers finish this tile
        (its first V load, or its Q when it has no KV tiles), so the barrier is never more
        than one completion ahead of the wait."""
        if O_IN_V and round_q > 0:
            o_ring.wait_empty(bars.o, round_q)

    @cuda.jit(device=True, forceinline=True)
    def v_key(n0, place, tile):
        """V's first row (its tile's key ``n0``), or e4m3 packed: the transposed V's column of
        that key (the sequence's keys start at ``fp8_prep.vt_start``, not at its K row)."""
        if FP8_VARLEN:
            return int32(vt_start(int64(place.start_k), int64(tile.batch)) + (n0 - place.start_k))
        return n0

    @cuda.jit(device=True, forceinline=True)
    def produce_tile(state, turn):
        """Q of one tile, then K_j and V_j of each of its KV tiles; returns the KV ring count
        after them."""
        maps, bars, tiles = state.maps, state.bars, state.tiles
        tile, n_tiles, round_q, place = turn.tile, turn.n_tiles, turn.round_q, turn.place
        if n_tiles == 0:
            wait_o_stored(bars, round_q)
        q_slot = q_ring.slot(round_q)
        q_ring.wait_empty(bars.q, round_q)  # consumers are done with this Q buffer
        q_ring.arm(bars.q, q_slot, Q_BYTES)
        load_tile(tiles.q + q_ring.offset(q_slot), maps.q, q_ring.full(bars.q, q_slot),
                  place.start_q + block_first_row(tile, place.problem, BM), tile.head, place.batch,
                  BM)  # rows < 0: zeros
        load = turn.kv0  # KV loads issued so far (all tiles): the ring position
        for j in range(n_tiles):
            s = kv_ring.slot(load)
            stage = kv_ring.offset(s)
            kv_ring.wait_empty(bars.k, load)
            kv_ring.arm(bars.k, s, K_BYTES)
            n0 = place.start_k + (turn.kv_first + j) * BN  # the tile's first key row
            load_tile(tiles.k + stage, maps.k, kv_ring.full(bars.k, s), n0, tile.kv_head, place.batch, BN)
            if j == 0:
                wait_o_stored(bars, round_q)
            kv_ring.wait_empty(bars.v, load)
            kv_ring.arm(bars.v, s, V_BYTES)
            load_v_tile(tiles.v + v_ring.offset(s), maps.v, kv_ring.full(bars.v, s), v_key(n0, place, tile),
                        tile.kv_head, place.batch, BN)
            load = kv_ring.advance(load, 1)
        return load

    walk = make_tile_walk(produce_tile, BM, BN, causal, window, varlen)

    @cuda.jit(device=True, forceinline=True)
    def produce(state):
        """One thread: every tile of this CTA."""
        walk(state, state.problem, state.seqs)

    return Producer(produce)


# ---------------------------------------------------------------------------------- consumer steps

def make_consumer_steps(config: WsConfig, causal: bool, bf16: bool, rings: Rings, window: bool = False,
                        softcap: bool = False) -> ConsumerSteps:
    """A consumer warpgroup's KV loop over one query tile, its GEMMs overlapped,
    with the ping-pong turns, the online softmax and the ring releases; and its pass over the
    KV tiles it skips. ``window``: scores outside the sliding window are masked (on the tiles that
    cross an edge); ``softcap``: scores are capped by tanh before the softmax."""
    BN = config.block_n
    D_N_TILES = config.value_dim // 8  # 8-column tiles of the O accumulator
    S_N_TILES = BN // 8
    P_K_STEPS = BN * config.element_bytes // 32  # k-steps of the PV wgmma (16 keys, or 32 in e4m3)
    CONSUMERS = config.consumers
    CAUSAL, BF16, FP8 = causal, bf16, config.fp8
    WINDOW, SOFTCAP = window, softcap
    O_IN_Q = config.o_in_q
    PINGPONG = config.pingpong
    LATE_PV_WAIT = config.late_pv_wait
    # Under ping-pong (16-bit, no softcap), the row maxes are adopted and O rescaled on every KV
    # tile, with no warp vote and no branch, as FlashAttention-4 does: alpha is exactly 1 where no
    # max grew, so the results are the lazy rescale's. H200, bf16 (docs/PERFORMANCE.md [RSA]): the
    # three-consumer d64 ping-pong builds +2-3% (three runs), d96 tied; without ping-pong it loses
    # 1-7%. The softcap builds keep the vote: with it, the d64 three-consumer causal packed softcap
    # build spilled 122 (sm_90a).
    RESCALE_ALWAYS = PINGPONG and not FP8 and not SOFTCAP
    q_ring, kv_ring, _, v_ring = rings
    issue_s, issue_pv, fence_s, fence_o = make_attention_gemms(config.head_dim, config.block_m, BN, bf16,
                                                               config.row_bytes, config.value_dim, FP8,
                                                               config.vt_row_bytes)

    @cuda.jit(device=True, forceinline=True)
    def pack_p(p_frag, acc_s):
        """P -> the PV product's A fragments: e4m3 (keys in ``fp8_layout.KEY_ORDER``), or 16-bit."""
        if FP8:
            pack_p_e4m3(p_frag, acc_s, P_K_STEPS)
        else:
            pack_p_fragments(p_frag, acc_s, P_K_STEPS, BF16)

    @cuda.jit(device=True, forceinline=True)
    def take_turn(seat):
        """Ping-pong: wait until the previous consumer (round robin) has issued its GEMMs."""
        if PINGPONG:
            hp.named_barrier_sync(TURN_BARRIER + seat.wg, 2 * WARPGROUP)

    @cuda.jit(device=True, forceinline=True)
    def pass_turn(seat):
        """Ping-pong: let the next consumer issue."""
        if PINGPONG:
            hp.named_barrier_arrive(TURN_BARRIER + (seat.wg + 1) % CONSUMERS, 2 * WARPGROUP)

    # ------------------------------------------------------------------ softmax

    @cuda.jit(device=True, forceinline=True)
    def adopt_maxes(stats):
        """m_run := max(m_run, mx); alpha := exp2(old - new) (1 while no key was seen);
        the row sums are rescaled now, O later (it may still be in a wgmma's hands)."""
        for r in range(2):
            stats.alpha[r] = adopt_row_max(stats.m_run, stats.l_run, stats.mx, r)

    @cuda.jit(device=True, forceinline=True)
    def rescale_o(acc_o, stats):
        """O's rows times the alpha of the last max change (``softmax.rescale_rows``, split)."""
        for r in range(2):
            scale_o_rows(acc_o, D_N_TILES, r, stats.alpha[r])

    @cuda.jit(device=True, forceinline=True)
    def softmax_scores(acc_s, stats, n0, sc):
        """Scores of the KV tile at key n0 -> probabilities in place (capped, masked,
        exponentiated against the new row maxes; row sums updated). True if the maxes moved:
        then O must be rescaled by ``stats.alpha`` (warp-uniform)."""
        at = sc.at
        if SOFTCAP:
            cap_scores(acc_s, S_N_TILES, sc.cap_scale)
        if WINDOW:
            if band_needs_mask(n0, BN, at.row_first, 16, sc.band):  # an edge of the window or the keys
                mask_band(acc_s, S_N_TILES, n0, at.row_first, at.lane, sc.band)
        else:
            mask_if_needed(acc_s, S_N_TILES, n0, BN, at, CAUSAL)
        scaled_row_maxes(acc_s, S_N_TILES, stats.mx, sc.scale_log2)
        if RESCALE_ALWAYS:
            grew = True
            adopt_maxes(stats)
        else:
            grew = cuda.any_sync(FULL_MASK, max_grew(stats.mx, stats.m_run, THRESHOLD))
            if grew:
                adopt_maxes(stats)
        if FP8:
            exponentiate_e4m3(acc_s, S_N_TILES, stats.m_run, stats.l_run, sc.scale_log2)
        else:
            exponentiate(acc_s, S_N_TILES, stats.m_run, stats.l_run, sc.scale_log2)
        return grew

    # ------------------------------------------------------------------ KV loops

    @cuda.jit(device=True, forceinline=True)
    def release_q(bars, work, seat):
        """Every S GEMM of the tile is done: the producer may load the next Q into this buffer
        (with O staged in Q, the epilogue releases it instead)."""
        if not O_IN_Q:
            q_ring.release(bars.q, work.round_q, seat.lane)

    @cuda.jit(device=True, forceinline=True)
    def first_s(acc_s, bars, descs, i, seat):
        """S = Q K_i alone (a tile's first), waited for at once; K_i's stage is released."""
        kv_ring.wait_full(bars.k, i)
        issue_s(acc_s, descs.q, hp.descriptor_add(descs.k, kv_ring.offset(kv_ring.slot(i))))
        hp.wgmma_wait_group_0()
        fence_s(acc_s)
        kv_ring.release(bars.k, i, seat.lane)

    @cuda.jit(device=True, forceinline=True)
    def paired_issue(acc, bars, descs, i, seat, accumulate):
        """S = Q K_i and O += P V_{i-1} issued together (a ping-pong turn; ``accumulate`` 0: the
        tile's first PV, O = P V); returns once S has completed (``wgmma.wait_group 1``) and
        K_i's stage is released: PV may still run."""
        acc_s = acc.s
        kv_ring.wait_full(bars.k, i)
        kv_ring.wait_full(bars.v, i - ONE)
        take_turn(seat)
        issue_s(acc_s, descs.q, hp.descriptor_add(descs.k, kv_ring.offset(kv_ring.slot(i))))
        issue_pv(acc.o, acc.p, hp.descriptor_add(descs.v, v_ring.offset(kv_ring.slot(i - ONE))), accumulate)
        pass_turn(seat)
        hp.wgmma_wait_group_1()
        fence_s(acc_s)
        kv_ring.release(bars.k, i, seat.lane)

    @cuda.jit(device=True, forceinline=True)
    def retire_pv(acc_o, bars, i, seat):
        """Wait for the PV in flight (with V_i) and release V_i's stage."""
        hp.wgmma_wait_group_0()
        fence_o(acc_o)
        kv_ring.release(bars.v, i, seat.lane)

    @cuda.jit(device=True, forceinline=True)
    def last_pv(acc, bars, descs, i, seat, accumulate):
        """O += P V_i alone (a tile's last; ``accumulate`` 0: also its first), waited for at once."""
        kv_ring.wait_full(bars.v, i)
        issue_pv(acc.o, acc.p, hp.descriptor_add(descs.v, v_ring.offset(kv_ring.slot(i))), accumulate)
        retire_pv(acc.o, bars, i, seat)

    @cuda.jit(device=True, forceinline=True)
    def attend_overlapped(acc, stats, bars, descs, work, seat, sc):
        """S_{j} and O += P_{j-1} V_{j-1} issued together; the softmax of S_j runs while
        PV_{j-1} is in flight; O is rescaled once PV_{j-1} has completed. With ping-pong only
        these paired issues take turns (the first S and the last PV of a tile do not). Q is
        released before the last PV; the tiles past ``n_own`` are skipped once it has completed."""
        acc_s, acc_o, p_frag = acc.s, acc.o, acc.p
        kv0, n_tiles = work.kv0, work.n_own
        n_first = work.kv_first * BN  # the block's first key
        if n_tiles > 0:
            first_s(acc_s, bars, descs, kv0, seat)
            softmax_scores(acc_s, stats, n_first, sc)  # no PV yet: nothing to rescale
            pack_p(p_frag, acc_s)
            for j in range(1, n_tiles):
                i = kv0 + uint32(j)
                paired_issue(acc, bars, descs, i, seat, ONE if j > 1 else ZERO)
                grew = softmax_scores(acc_s, stats, n_first + j * BN, sc)
                if LATE_PV_WAIT:
                    # after the row sums (every exponential); ptxas hoists PV's wait no higher
                    hp.fence_acq_rel_cta_after(stats.l_run[0], stats.l_run[1])
                retire_pv(acc_o, bars, i - ONE, seat)
                if grew:
                    rescale_o(acc_o, stats)
                pack_p(p_frag, acc_s)
        release_q(bars, work, seat)
        if n_tiles > 0:
            last_pv(acc, bars, descs, kv0 + uint32(n_tiles) - ONE, seat, ONE if n_tiles > 1 else ZERO)
        skip_tiles(bars, kv0, n_tiles, work.n_tiles, seat)

    @cuda.jit(device=True, forceinline=True)
    def skip_tiles(bars, kv0, first, n_tiles, seat):
        """KV tiles ``first`` .. ``n_tiles`` - 1 of the block, which this warpgroup does not
        read (its rows all lie past seqlen_q, or, causal, before the tile's first key): no
        GEMMs, but the rings and the ping-pong turns stay in step. A stage is released only
        once it is full (an arrival before would count for the wrong round); the turns of the
        paired issues (every tile but the block's first) pass straight on."""
        for j in range(first, n_tiles):
            i = kv0 + uint32(j)
            if j > 0:
                take_turn(seat)
                pass_turn(seat)
            kv_ring.wait_full(bars.k, i)
            kv_ring.release(bars.k, i, seat.lane)
            kv_ring.wait_full(bars.v, i)
            kv_ring.release(bars.v, i, seat.lane)

    return ConsumerSteps(attend_overlapped, skip_tiles, release_q)


# ---------------------------------------------------------------------------------- epilogue

def make_epilogue(config: WsConfig, bf16: bool, rings: Rings, varlen: bool = False) -> Epilogue:
    """A consumer warpgroup's end of a query tile: O normalised, staged in shared memory by
    stmatrix and stored by TMA (in its own tile, the Q buffer or the V ring), then the LSE. O
    has V's head dim (``config.value_dim``)."""
    D, BM = config.value_dim, config.block_m
    D_N_TILES = D // 8  # 8-column tiles of the O accumulator
    RB = config.o_row_bytes  # O is 16-bit whatever the inputs
    BOX = config.o_box_cols
    D_CHUNKS = D // BOX
    CHUNKS_PER_ROW = RB // 16  # 16-byte chunks in a block row (8 or 4)
    CONSUMER_THREADS = config.consumers * WARPGROUP
    EPILOGUE_BARRIER = epilogue_barrier(config)
    V_READ_BARRIER = EPILOGUE_BARRIER + config.consumers  # o_in_v: every consumer is done reading V
    BF16 = bf16
    O_IN_Q, O_IN_V = config.o_in_q, config.o_in_v
    VARLEN = varlen
    ROW_CHUNKS = D * 2 // 16  # 16-byte chunks of an O row
    q_ring = rings.q

    @cuda.jit(device=True, forceinline=True)
    def normalise_o(acc_o, stats):
        """O /= row sum (0 for rows that saw no key); leaves the quad-summed sums in l_run."""
        for r in range(2):
            scale_o_rows(acc_o, D_N_TILES, r, row_sum_inverse(stats.l_run, r))

    @cuda.jit(device=True, forceinline=True)
    def stage_o(tile_o, acc_o, seat, regs):
        """stmatrix this warp's 16 O rows into the swizzled O tile (as TMA reads it): one x4
        per pair of 8-column tiles; lane 8i + r gives row r of matrix i (i = 2 * (column tile
        - j) + row half). 16-byte chunk c of a block row r sits at c ^ (r % 8) (128B swizzle)
        or c ^ ((r // 2) % 4) (64B swizzle); rows start at a multiple of 8, so r % 8 = r8."""
        matrix = seat.lane // 8
        r8 = seat.lane % 8
        phase = swizzle_phase(r8, RB)
        row = seat.wg * WG_ROWS + seat.warp * 16 + (matrix % 2) * 8 + r8
        for jj in range(D_N_TILES // 2):
            j = 2 * jj
            regs[0] = pack_16bit(acc_o[j, 0], acc_o[j, 1], BF16)
            regs[1] = pack_16bit(acc_o[j, 2], acc_o[j, 3], BF16)
            regs[2] = pack_16bit(acc_o[j + 1, 0], acc_o[j + 1, 1], BF16)
            regs[3] = pack_16bit(acc_o[j + 1, 2], acc_o[j + 1, 3], BF16)
            col = j + matrix // 2  # 16-byte chunk of the row
            address = (tile_o + (col // CHUNKS_PER_ROW) * (BM * RB) + row * RB
                       + (((col % CHUNKS_PER_ROW) ^ phase) * 16))
            hp.stmatrix_x4(uint32(address), regs)

    @cuda.jit(device=True, forceinline=True)
    def store_o(acc_o, stats, tile_o, io, tile, place, seat, regs, o_read):
        """Normalised O -> shared (stmatrix) -> global (TMA store of this warpgroup's rows;
        the map clips rows past seqlen_q; varlen: each warp stores its own 16 rows with 16-byte
        stores, none past its sequence's end). With O staged in the Q buffer or the V ring, the
        storer arrives on ``o_read`` (the Q buffer's empty barrier, or O empty) once the stores
        have read the tile."""
        normalise_o(acc_o, stats)
        barrier = EPILOGUE_BARRIER + seat.wg
        if seat.thread == 0:
            hp.tma_store_wait_group_read_0()  # the previous tile's store has read the tile
        if O_IN_V:  # every consumer warpgroup has finished its PV GEMMs: V is free
            hp.named_barrier_sync(V_READ_BARRIER, CONSUMER_THREADS)
        else:
            hp.named_barrier_sync(barrier, WARPGROUP)
        stage_o(tile_o, acc_o, seat, regs)
        if VARLEN:  # the warp's own rows, back from shared memory (its stmatrix wrote them)
            cuda.syncwarp()
            out, rows = io.out, seat.wg * WG_ROWS + seat.warp * 16  # the warp's first row in the tile
            first = place.start_q * out.row_stride + tile.head * out.head_stride  # (sequence, head) row 0
            dst = global_rows(out.o, first, out.row_stride, place.problem.seqlen_q)
            store_rows_global(dst, block_first_row(tile, place.problem, BM) + rows, tile_o, BM, rows, 16,
                              ROW_CHUNKS, seat.lane, regs, RB)
            if O_IN_Q or O_IN_V:
                hp.named_barrier_sync(barrier, WARPGROUP)  # every warp has read its rows
                if seat.thread == 0:
                    hp.mbarrier_arrive(o_read)  # one arrival per consumer warpgroup
        else:
            hp.fence_proxy_async_shared_cta()  # stmatrix writes -> visible to the TMA store
            hp.named_barrier_sync(barrier, WARPGROUP)
            if seat.thread == 0:
                row0 = block_first_row(tile, place.problem, BM) + seat.wg * WG_ROWS
                for c in range(D_CHUNKS):
                    hp.tma_store_4d(io.maps.o, tile_o + c * BM * RB + seat.wg * WG_ROWS * RB, int32(c * BOX),
                                    int32(tile.head), int32(row0), int32(tile.batch))
                hp.tma_store_commit_group()
                if O_IN_Q or O_IN_V:
                    hp.tma_store_wait_group_read_0()  # the next Q (V) may land here now
                    hp.mbarrier_arrive(o_read)  # one arrival per consumer warpgroup

    @cuda.jit(device=True, forceinline=True)
    def finish_tile(acc_o, stats, io, tile, place, at, round_q, seat, regs):
        """The epilogue of a query tile: O normalised and stored, then the LSE ((batch, heads_q,
        seqlen_q), or varlen (heads_q, total_q))."""
        if O_IN_Q:
            q_slot = q_ring.slot(round_q)
            store_o(acc_o, stats, io.tiles.q + q_ring.offset(q_slot), io, tile, place, seat, regs,
                    q_ring.empty(io.bars.q, q_slot))
        else:
            store_o(acc_o, stats, io.tiles.o, io, tile, place, seat, regs, io.bars.o.empty)
        if io.write_lse:
            problem = place.problem
            if VARLEN:
                base = tile.head * io.out.lse_head_stride + place.start_q
            else:
                base = (tile.batch * problem.heads_q + tile.head) * problem.seqlen_q
            store_lse(io.lse, base, at.row_first, problem.seqlen_q, stats.m_run, stats.l_run, seat.lane)

    return Epilogue(finish_tile)


# ---------------------------------------------------------------------------------- consumer

def make_consumer(config: WsConfig, causal: bool, bf16: bool, rings: Rings, window: bool = False,
                  softcap: bool = False, varlen: bool = False, sink: bool = False) -> Consumer:
    """A consumer warp: for each tile of the walk, its warpgroup's 64 rows (S, softmax and PV over
    the KV tiles they see, then the epilogue), or a pass over the tile that keeps the rings and
    turns in step. ``sink``: each tile's softmax starts with the learnable sink's term of its head
    (``softmax.start_at_sink``)."""
    D, BM, BN = config.value_dim, config.block_m, config.block_n  # D: O's columns (V's head dim)
    D_N_TILES = D // 8
    S_N_TILES = BN // 8
    P_K_STEPS = BN * config.element_bytes // 32  # k-steps of the PV wgmma
    RB = config.row_bytes
    CONSUMERS = config.consumers
    CAUSAL = causal
    SINK = sink
    FP8, SOFTCAP = config.fp8, softcap
    VARLEN = varlen
    O_IN_Q = config.o_in_q
    PINGPONG = config.pingpong
    # A consumer warpgroup whose 64 rows all lie past seqlen_q skips the tile (skip_tiles)
    # with 192-row tiles, where 1024 rows fill 5 1/3 blocks; with 2 consumers the branch cost
    # the 240-register causal kernels spills and their uniform-register schedule arithmetic.
    SKIP_IDLE = CONSUMERS == 3
    # Causal, 192-row tiles: a warpgroup skips the block's KV tiles past its own rows' diagonal
    # (its first 64 rows never see the last 128 keys of the block's range: 1 tile in 10 at 1k).
    SKIP_MASKED = CAUSAL and CONSUMERS == 3
    LEAD_ROWS = SKIP_MASKED  # the first block may start before row 0 (WsConfig.first_block_lead)
    q_ring, kv_ring, _, _ = rings
    steps = make_consumer_steps(config, causal, bf16, rings, window, softcap)
    epilogue = make_epilogue(config, bf16, rings, varlen)
    # Descriptors of K-major (Q, K) and MN-major (V) tiles in this head dim's swizzle; e4m3: of the
    # transposed V, K-major in its own swizzle.
    desc_k_major = hp.smem_descriptor_k_sw128 if RB == 128 else hp.smem_descriptor_k_sw64
    desc_mn_major = hp.smem_descriptor_mn_sw128 if RB == 128 else hp.smem_descriptor_mn_sw64
    desc_vt = hp.smem_descriptor_k_sw128 if config.vt_row_bytes == 128 else hp.smem_descriptor_k_sw64
    fence_o = hp.wgmma_fence_operand(D)

    @cuda.jit(device=True, forceinline=True)
    def own_kv_tiles(first_row, n_tiles, problem):
        """The first KV tiles of the block that this warpgroup's rows from ``first_row`` can
        see (causal); the block's later tiles lie wholly past their diagonal."""
        diag = problem.seqlen_k - problem.seqlen_q
        n = visible_kv_tiles(int32(first_row), WG_ROWS, BN, problem.seqlen_k, diag, CAUSAL)
        return min(max(n, 0), n_tiles)

    @cuda.jit(device=True, forceinline=True)
    def zero_o(acc_o):
        for j in range(D_N_TILES):
            for e in range(4):
                acc_o[j, e] = 0.0

    @cuda.jit(device=True, forceinline=True)
    def reset_stats(stats, io, head):
        """The running maxes and sums before a tile's first KV tile: -inf and 0, or (sink kernels)
        the learnable sink's term of query head ``head``."""
        if SINK:
            start_at_sink(stats.m_run, stats.l_run, sink_logit(io.sink, head))
            if FP8:  # the sink's term carries P's scale, as every other term of the sums
                for r in range(2):
                    stats.l_run[r] *= float32(P_SCALE_E4M3)
        else:
            for r in range(2):
                stats.m_run[r] = NEG_INF
                stats.l_run[r] = 0.0

    @cuda.jit(device=True, forceinline=True)
    def tile_mask(tile, problem, seat):
        """The mask position of this warp's 16 rows of the query block."""
        row_first = block_first_row(tile, problem, BM) + seat.wg * WG_ROWS + seat.warp * 16
        return ScoreMask(row_first, seat.lane, problem.seqlen_k, problem.seqlen_k - problem.seqlen_q)

    @cuda.jit(device=True, forceinline=True)
    def descale_pair(work):
        """e4m3: the index of the tile's (batch, KV head) in the descales (varlen: the sequence's)."""
        problem = work.place.problem
        batch = work.tile.batch if VARLEN else work.place.batch  # (a packed Place's batch is 0)
        return batch * (problem.heads_q // problem.group) + work.tile.kv_head

    @cuda.jit(device=True, forceinline=True)
    def scoring(io, work, at):
        """How this tile's scores become probabilities; e4m3: the raw scores are times q's and k's
        descales of the tile's (batch, KV head), folded into the exponent factor (or the softcap's)."""
        problem = work.place.problem
        band = Band(problem.seqlen_k, problem.first, problem.last)
        if FP8:
            pair = descale_pair(work)
            qk = io.descales.q[pair] * io.descales.k[pair]
            if SOFTCAP:
                return Scoring(at, band, io.scale_log2, io.cap_scale * qk)
            return Scoring(at, band, io.scale_log2 * qk, io.cap_scale)
        return Scoring(at, band, io.scale_log2, io.cap_scale)

    @cuda.jit(device=True, forceinline=True)
    def descale_o(acc_o, stats, io, work):
        """e4m3: O times v's descale of the tile's (batch, KV head), and O and the row sums over
        P's scale (``softmax.P_SCALE_E4M3``, which both carry)."""
        pair = descale_pair(work)
        v = io.descales.v[pair] * float32(1.0 / P_SCALE_E4M3)
        for r in range(2):
            scale_o_rows(acc_o, D_N_TILES, r, v)
            stats.l_run[r] *= float32(1.0 / P_SCALE_E4M3)

    @cuda.jit(device=True, forceinline=True)
    def attend_tile(acc, stats, descs, io, work, seat):
        """One query tile for this warpgroup: S, softmax and PV over its KV tiles, then the
        epilogue (O, LSE) and the Q buffer's release."""
        if work.n_own == 0:  # no PV will write O (the first one overwrites it)
            zero_o(acc.o)
            fence_o(acc.o)  # keeps this a branch: speculated, it is 128 selects on every tile
        reset_stats(stats, io, work.tile.head)
        at = tile_mask(work.tile, work.place.problem, seat)
        sc = scoring(io, work, at)
        q_ring.wait_full(io.bars.q, work.round_q)
        q_at = q_ring.offset(q_ring.slot(work.round_q))
        tile_descs = Descriptors(hp.descriptor_add(descs.q, q_at), descs.k, descs.v)
        steps.attend_overlapped(acc, stats, io.bars, tile_descs, work, seat, sc)
        if FP8:
            descale_o(acc.o, stats, io, work)
        epilogue.finish_tile(acc.o, stats, io, work.tile, work.place, at, work.round_q, seat, acc.regs)

    @cuda.jit(device=True, forceinline=True)
    def pass_over_tile(bars, turn, seat):
        """A tile none of this warpgroup's rows lie in (past seqlen_q): its Q and KV stages are
        waited for and released, as attend_tile would, with no GEMM."""
        q_ring.wait_full(bars.q, turn.round_q)
        steps.skip_tiles(bars, turn.kv0, 0, turn.n_tiles, seat)
        if O_IN_Q:
            if seat.thread == 0:
                hp.mbarrier_arrive(q_ring.empty(bars.q, q_ring.slot(turn.round_q)))  # as store_o does
        else:
            q_ring.release(bars.q, turn.round_q, seat.lane)

    @cuda.jit(device=True, forceinline=True)
    def consume_tile(state, turn):
        """One tile of the walk for this warp; returns the KV ring count after it."""
        seat, problem = state.seat, turn.place.problem
        first_row = block_first_row(turn.tile, problem, BM) + seat.wg * WG_ROWS
        if not SKIP_IDLE or ((not LEAD_ROWS or first_row >= 0) and first_row < problem.seqlen_q):
            n_own = own_kv_tiles(first_row, turn.n_tiles, problem) if SKIP_MASKED else turn.n_tiles
            work = TileWork(turn.tile, uint32(turn.kv0), uint32(turn.round_q), turn.n_tiles, n_own,
                            turn.kv_first, turn.place)
            attend_tile(state.acc, state.stats, state.descs, state.io, work, seat)
        else:  # every row of this warpgroup lies past seqlen_q
            pass_over_tile(state.io.bars, turn, seat)
        return kv_ring.advance(turn.kv0, turn.n_tiles)  # after the branch: the ring positions stay uniform

    walk = make_tile_walk(consume_tile, BM, BN, causal, window, varlen)

    @cuda.jit(device=True, forceinline=True)
    def consume(io, seat):
        """Every tile of this CTA: S, softmax and PV over its KV tiles, then the epilogue."""
        acc_o = cuda.local.array((D_N_TILES, 4), float32)
        acc_s = cuda.local.array((S_N_TILES, 4), float32)
        p_frag = cuda.local.array((P_K_STEPS, 4), uint32)
        acc = Accumulators(acc_s, acc_o, p_frag, cuda.local.array(4, uint32))
        stats = RowStats(cuda.local.array(2, float32), cuda.local.array(2, float32),
                         cuda.local.array(2, float32), cuda.local.array(2, float32))
        tiles = io.tiles
        descs = Descriptors(desc_k_major(tiles.q + seat.wg * WG_ROWS * RB), desc_k_major(tiles.k),
                            desc_vt(tiles.v) if FP8 else desc_mn_major(tiles.v, BN * RB))
        if PINGPONG and seat.wg == CONSUMERS - 1:
            hp.named_barrier_arrive(TURN_BARRIER, 2 * WARPGROUP)  # consumer 0 issues first
        walk(ConsumerState(acc, stats, descs, io, seat), io.problem, io.seqs)
        if PINGPONG and seat.wg == 0:
            hp.named_barrier_sync(TURN_BARRIER, 2 * WARPGROUP)  # the last consumer's last hand-over
        if seat.thread == 0:
            hp.tma_store_wait_group_0()  # the O tile stays valid until the stores are done

    return Consumer(consume)


# ---------------------------------------------------------------------------------- kernel

def make_forward_ws_kernel(config: WsConfig, causal: bool, bf16: bool, window: bool = False,
                           softcap: bool = False, varlen: bool = False, sink: bool = False):
    """Return the Python kernel function for ``config`` (jit it with ``params.WS_FORWARD``, or
    ``params.VARLEN_WS_FORWARD``, and ``launch_bounds=(config.threads, 1)``; grid: persistent, at most
    one CTA per SM).

    ``window``: a sliding-window kernel (``window_left`` / ``window_right`` arguments, each >= 0;
    ``causal`` must then be False: the window's right edge 0 is causal masking): each query block
    reads only the KV tiles between its window edges (``blocks.block_band_tiles``), and the tiles
    that cross an edge are masked (``blocks.mask_band``). ``softcap``: scores capped by tanh
    (``cap_scale`` argument = softmax_scale / softcap, and ``scale_log2`` = softcap·log2(e);
    ``softmax.cap_scores``). Kernels without them never read those arguments. ``varlen``: packed
    sequences (``flash_attention_varlen``): the walk reads each block's sequence from the offsets
    and passes over the blocks past its end (``blocks.sequence_place``), the tensor maps are over
    (1, total, heads, head_dim) views, and the threads store O (no TMA store: it would clip only at
    total_q) and the (heads_q, total_q) LSE; seqlen_q and seqlen_k are the maxima. ``sink``: a
    learnable sink (``params.SINK`` last: float32 (heads_q,) logits) starts each row's softmax
    (``make_consumer``); kernels without it compile as before it existed. ``config.fp8``: e4m3 q, k
    and v (``params.DESCALES`` after the others: their float32 (batch * heads_kv,) descales), V
    transposed (``fp8_layout``), O in ``bf16``'s 16-bit type. The kernel is the body's
    entry, generated from its declaration (``params.entry``)."""
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    config.check()
    D, BM, BN, STAGES = config.head_dim, config.block_m, config.block_n, config.stages
    CONSUMERS = config.consumers
    QS = config.q_stages
    # Byte offsets of the tiles from the aligned base, and of the mbarriers in their word array
    # (plain ints: constants in the kernel).
    Q_AT, K_AT, V_AT, O_AT, _ = config.shared_layout
    Q_FULL_AT, Q_EMPTY_AT, K_FULL_AT, K_EMPTY_AT, V_FULL_AT, V_EMPTY_AT, O_EMPTY_AT, BARRIER_WORDS = (
        config.barrier_layout)
    assert Q_FULL_AT == 0 and Q_AT == 0
    # Causal, 192-row tiles: the blocks end at seqlen_q (the first starts up to 128 rows before
    # row 0), so a ragged block is the first, which sees the fewest keys, not the last and
    # heaviest, where its lone warpgroup would run the block's every tile while the others wait.
    LEAD_ROWS = causal and CONSUMERS == 3 and not varlen  # (packed sequences: no lead)
    SKIP_IDLE = CONSUMERS == 3  # (make_consumer)
    # The warpgroup index by a lane-0 broadcast (``warp_uniform``) also where no branch needs it:
    # ptxas then keeps the wgmma descriptors in uniform registers (about half the R2UR moves).
    # Measured on an H200 at 4k (bf16, 3 alternated rounds, [UWG]): d96 +1.1% / +1.8% (full /
    # causal); d128 128 x 128 -1.5 to -2.2%, 128 x 176 tied, d256 -1 to -4% (and its packed window
    # builds spill): so d96 only.
    UNIFORM_WG = SKIP_IDLE or config.head_dim == 96
    O_IN_Q = config.o_in_q
    lower_registers = getattr(hp, f"setmaxnreg_dec_{config.register_split[0]}")
    raise_registers = getattr(hp, f"setmaxnreg_inc_{config.register_split[1]}")
    rings = make_rings(config)
    q_ring, kv_ring, _, _ = rings
    producer = make_producer(config, causal, rings, window, varlen)
    consumer = make_consumer(config, causal, bf16, rings, window, softcap, varlen, sink)

    @cuda.jit(device=True, forceinline=True)
    def run_cta(params, seqs, out, sink, descales):
        """The kernel's body (``params``: a WsParams); ``seqs`` and ``out``: a PackedSequences and
        a PackedOut (varlen), or unused placeholders; ``sink``: the sink's logits, or unused;
        ``descales``: the Descales (e4m3), or unused."""
        smem = cuda.shared.array(0, types.uint16)
        bar_words = cuda.shared.array(BARRIER_WORDS, types.uint64)
        tid = cuda.threadIdx.x
        base = (ptx.shared_address_u16(smem) + 1023) & ~uint32(1023)  # swizzle atoms: 1024-aligned
        tiles = Tiles(base + Q_AT, base + K_AT, base + V_AT, base + O_AT)
        b = ptx.shared_address_u64(bar_words)
        # (the Q ring's full barriers start the array: b itself keeps its 32-bit type)
        k_full = b + K_FULL_AT  # (first: the order of these adds reaches the SASS)
        q = RingBarriers(b, b + Q_EMPTY_AT)
        k = RingBarriers(k_full, b + K_EMPTY_AT)
        v = RingBarriers(b + V_FULL_AT, b + V_EMPTY_AT)
        o_empty = b + O_EMPTY_AT
        bars = Barriers(q, k, v, RingBarriers(o_empty, o_empty))
        maps = Maps(params.map_q, params.map_k, params.map_v, params.map_o)
        diag = int64(params.seqlen_k - params.seqlen_q)  # query i sees keys j <= i + diag (causal)
        problem = Problem(params.seqlen_q, params.seqlen_k, params.heads_q, params.group, params.batch_size,
                          int32((params.seqlen_q + BM - 1) // BM), params.row_lead if LEAD_ROWS else int32(0),
                          diag - params.window_left, diag + params.window_right)
        consumer_warps = CONSUMERS * WARPGROUP // 32
        # Q is released by every consumer warp, or (O staged in Q) by each warpgroup's storer.
        q_releases = CONSUMERS if O_IN_Q else consumer_warps
        if tid == 0:
            for s in range(QS):
                hp.mbarrier_init(q_ring.full(bars.q, s), 1)
                hp.mbarrier_init(q_ring.empty(bars.q, s), q_releases)
            for s in range(STAGES):
                hp.mbarrier_init(kv_ring.full(bars.k, s), 1)
                hp.mbarrier_init(kv_ring.empty(bars.k, s), consumer_warps)
                hp.mbarrier_init(kv_ring.full(bars.v, s), 1)
                hp.mbarrier_init(kv_ring.empty(bars.v, s), consumer_warps)
            hp.mbarrier_init(bars.o.empty, CONSUMERS)  # each warpgroup's storer (o_in_v)
            hp.fence_mbarrier_init()
            hp.tma_prefetch_descriptor(params.map_q)
            hp.tma_prefetch_descriptor(params.map_k)
            hp.tma_prefetch_descriptor(params.map_v)
            hp.tma_prefetch_descriptor(params.map_o)
        cuda.syncthreads()  # the last CTA-wide barrier: the roles part here
        warpgroup = tid // WARPGROUP
        if warpgroup == 0:
            lower_registers()
            if tid == 0:
                producer.produce(ProducerState(maps, bars, tiles, problem, seqs))
        else:
            raise_registers()
            thread = uint32(tid - WARPGROUP)
            wg = thread // uint32(WARPGROUP)
            if UNIFORM_WG:  # with SKIP_IDLE, a branch on it (skip_tiles) keeps the ring arithmetic uniform
                wg = uint32(warp_uniform(wg))
            seat = Seat(wg, (thread // uint32(32)) % uint32(4), thread % uint32(32),
                        thread % uint32(WARPGROUP))
            io = Io(maps, bars, tiles, problem, params.lse, params.write_lse, params.scale_log2,
                    params.cap_scale, seqs, out, sink, descales)
            consumer.consume(io, seat)

    declared = ((declarations.VARLEN_WS_FORWARD if varlen else declarations.WS_FORWARD)
                + (declarations.DESCALES if config.fp8 else ()) + (declarations.SINK if sink else ()))
    placed = ("PackedSequences(cu_seqlens_q, cu_seqlens_k, window_left, window_right), "
              "PackedOut(o, o_row_stride, o_head_stride, total_q)") if varlen else "int32(0), int32(0)"
    descaled = "Descales(q_descale, k_descale, v_descale)" if config.fp8 else "int32(0)"
    flash_forward_ws = declarations.entry(
        "flash_forward_ws", declared,
        f"run_cta(WsParams({', '.join(declarations.names_of(declarations.WS_FORWARD))}), {placed}, "
        f"{'sink' if sink else 'int32(0)'}, {descaled})",
        {"run_cta": run_cta, "WsParams": WsParams, "PackedSequences": PackedSequences, "PackedOut": PackedOut,
         "Descales": Descales, "int32": int32})

    dims = f"d{D}v{config.value_dim}" if config.value_dim != D else f"d{D}"
    flash_forward_ws.__name__ = (
        f"flash_forward_ws_{dims}_m{BM}_n{BN}_s{STAGES}"
        f"{'_pp' if config.pingpong else ''}{'_oq' if O_IN_Q else ''}{'_ov' if config.o_in_v else ''}"
        f"{'_lw' if config.late_pv_wait else ''}_"
        f"{'varlen_' if varlen else ''}{'window' if window else 'causal' if causal else 'full'}"
        f"{'_softcap' if softcap else ''}_"
        f"{'e4m3_' if config.fp8 else ''}{'bf16' if bf16 else 'f16'}{'_sink' if sink else ''}"
    )
    # One CTA per SM; the cap at entry (65536 / threads) is what setmaxnreg moves around.
    flash_forward_ws.launch_bounds = (config.threads, 1)
    return flash_forward_ws
