"""Compile-time shapes of the forward kernels, in plain Python: the config table, dispatch and
the kernel cache read them without importing Numba (``import numbaflash`` stays light).

``ForwardConfig`` shapes the mma.sync kernel (``forward_mma``), ``WsConfig`` the
warp-specialised Hopper kernel (``forward_ws``). Each checks itself (``check()``) and knows
its launch shape.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

# Q's and K's head dim above 256 that the mma.sync kernels take, with V's at most 256 (O's registers
# are d256's): head dim 512 runs as two calls of (512, 256), one per half of V
# (``operations.head_dims``). Their S = Q Kᵀ loops are unrolled in Python there.
WIDE_HEAD_DIM = 512
WARPGROUP_ROWS = 64  # query rows of one consumer warpgroup of the Hopper kernel (wgmma m64)
MBARRIER_BYTES = 8  # one mbarrier: a 64-bit shared word
SMEM_ALIGN = 1024  # the Hopper kernel's tiles start 1024-aligned (swizzle atoms)


class SharedLayout(NamedTuple):
    """Byte offsets of the Hopper kernel's shared tiles from the aligned base: the Q buffers,
    the K ring, the V ring and the O staging tile (at the V ring with ``o_in_v``; unused with
    ``o_in_q``), and the end of the last."""

    q: int
    k: int
    v: int
    o: int
    end: int


class BarrierLayout(NamedTuple):
    """Byte offsets of the Hopper kernel's mbarriers in their 64-bit word array: the full and
    empty barriers of the Q, K and V rings (one per stage, 8 bytes apart), then O empty;
    ``words``: the array's length."""

    q_full: int
    q_empty: int
    k_full: int
    k_empty: int
    v_full: int
    v_empty: int
    o_empty: int
    words: int


class ValueDim:
    """What the configs that take V's head dim apart share (``head_dim_v``, a field of each: 0
    for "the same", so that every other config and kernel name stays as it was): one spelling
    per kernel (``head_dim_v`` equal to ``head_dim`` becomes 0), and ``value_dim``, V's (and O's,
    dO's, dV's) head dim."""

    def __post_init__(self) -> None:
        if self.head_dim_v == self.head_dim:  # one spelling per kernel: 0 is "the same"
            object.__setattr__(self, "head_dim_v", 0)

    @property
    def value_dim(self) -> int:
        return self.head_dim_v or self.head_dim


@dataclasses.dataclass(frozen=True)
class ForwardConfig(ValueDim):
    """Compile-time shape of the forward kernel."""

    head_dim: int
    block_m: int = 128  # query rows per CTA
    block_n: int = 64  # keys per KV tile
    warp_m_tiles: int = 1  # 16-row m-tiles per warp: 2 halves the shared-memory reads per MMA
    # Q (the A operand of S = Q Kᵀ) held in registers for the whole KV loop (True), or loaded
    # from the Q tile one 16-column k-slice at a time (False: fewer registers, one more
    # ldmatrix per k-slice). Always False above head_dim 128 (O alone is 128 registers there).
    q_in_regs: bool = True
    # Register double buffering: each GEMM step issues the ldmatrix of its next K / V (and Q)
    # fragments before the mma.sync of the current ones.
    double_buffer: bool = False
    # Issue the copy of K_{j+1} right after S_j = Q K_jᵀ (one more barrier a tile) instead of
    # after the softmax, so that it overlaps the softmax too.
    early_k: bool = False
    # Wait for V_j right after S_j = Q K_jᵀ (the barrier that frees K_j, whose next copy then
    # overlaps the softmax as with early_k), and exponentiate P one 16-key slice at a time, each
    # slice followed by its PV mma.sync: with no barrier between them ptxas can overlap a warp's
    # exponentials (MUFU) with its PV (tensor cores). Implies the early K copy: early_k must be False.
    interleave_pv: bool = False
    # V's (and O's) head dim where it differs from Q's and K's (``head_dim``): 0 for the same.
    # DeepSeek-V3-style attention takes (192, 128). A shape, not a knob: it is the call's.
    head_dim_v: int = 0
    # q, k and v in e4m3 (one byte an element; sm_89 on), O in 16 bits: S and PV as mma.sync
    # m16n8k32, V transposed as for the Hopper e4m3 kernel (``fp8_layout``), Q resident. A dtype of
    # the call, not a knob (``configs.FP8_MMA_DEFAULTS``).
    fp8: bool = False
    # CTAs an SM the registers must leave room for: ptxas then keeps a thread within
    # 65536 / (threads * min_ctas) registers (launch bounds). 1 lets a thread use 255 registers.
    # Not a knob: 3 (at most 168 registers, 3 warps a scheduler instead of 2) lost 5-20% on an
    # H100 and tied at d32, and no shipped or tuned config used another value.
    min_ctas: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.head_dim > 128 and self.q_in_regs and not self.fp8:  # one spelling per kernel: Q is
            object.__setattr__(self, "q_in_regs", False)  # never resident there (e4m3: half the bytes)
        super().__post_init__()

    @property
    def element_bytes(self) -> int:
        """Bytes of one q, k or v element: 1 (e4m3) or 2."""
        return 1 if self.fp8 else 2

    @property
    def row_bytes(self) -> int:
        """Bytes per row of one swizzle column block of the Q and K tiles: 128 where 128 divides a
        row's bytes (64 columns of 16 bits, 128 of e4m3), else 64."""
        return 128 if (self.head_dim * self.element_bytes) % 128 == 0 else 64

    @property
    def o_row_bytes(self) -> int:
        """Of the 16-bit O rows the epilogue stages (``row_bytes`` but for e4m3 configs)."""
        return 128 if self.value_dim % 64 == 0 else 64

    @property
    def vt_row_bytes(self) -> int:
        """e4m3: bytes (keys) per row of one swizzle block of the transposed V tile (head-dim rows
        of ``block_n`` keys): 128 where 128 divides block_n, else 64."""
        return 128 if self.block_n % 128 == 0 else 64

    @property
    def tag(self) -> str:
        """Kernel-name suffix of the non-default knobs (empty for the original kernel)."""
        return ("_qs" if not self.q_in_regs and self.head_dim <= 128 else "") + (
            "_db" if self.double_buffer else "") + ("_ek" if self.early_k else "") + (
            "_ip" if self.interleave_pv else "")

    @property
    def num_warps(self) -> int:
        return self.block_m // (16 * self.warp_m_tiles)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def shared_bytes(self) -> int:
        """Q tile + one K tile + one V tile, 16-bit elements (e4m3: bytes; O's 16-bit rows are then
        staged over the Q and K tiles, so ``check`` keeps block_n >= block_m)."""
        e = self.element_bytes
        return ((self.block_m + self.block_n) * self.head_dim + self.block_n * self.value_dim) * e

    def check(self) -> None:
        if self.fp8:
            self._check_fp8()
        if not (self.head_dim == WIDE_HEAD_DIM and 0 < self.head_dim_v <= 256) and (
                self.head_dim % 32 or not 32 <= self.head_dim <= 256):
            raise ValueError(f"head_dim must be a multiple of 32 from 32 to 256 (or {WIDE_HEAD_DIM} with "
                             f"head_dim_v at most 256), got {self.head_dim}")
        if self.head_dim > 256 and self.double_buffer:
            raise ValueError(f"head_dim {self.head_dim} runs without double_buffer (its S loop is "
                             f"unrolled in Python only there), got {self}")
        if self.head_dim_v:
            # O is staged in the Q tile (so at most head_dim wide), and the tiles share one swizzle
            # (so both multiples of 64, or neither).
            if self.head_dim_v % 32 or not 32 <= self.head_dim_v <= self.head_dim:
                raise ValueError(f"head_dim_v must be a multiple of 32 from 32 to head_dim "
                                 f"({self.head_dim}), got {self.head_dim_v}")
            if (self.head_dim % 64 == 0) != (self.head_dim_v % 64 == 0):
                raise ValueError(f"head_dim {self.head_dim} and head_dim_v {self.head_dim_v} must both be "
                                 "multiples of 64 or neither (one shared-memory swizzle)")
        if self.block_m % (16 * self.warp_m_tiles) or self.block_n % 16:
            raise ValueError(f"block_m and block_n must be multiples of 16, got {self}")
        if self.double_buffer and self.block_n % 32:
            raise ValueError(f"double_buffer needs block_n a multiple of 32 (K loads in pairs), got {self}")
        if self.interleave_pv and self.early_k:
            raise ValueError("interleave_pv already copies K_(j+1) right after S_j: early_k must be False, "
                             f"got {self}")
        block_chunks = self.row_bytes // 16  # 16-byte chunks per swizzle block row
        if self.threads // block_chunks % 8:
            raise ValueError(f"{self.threads} threads do not copy whole 8-row swizzle groups")
        e = self.element_bytes
        tiles = ((self.block_m, self.head_dim * e), (self.block_n, self.head_dim * e),
                 (self.block_n, self.value_dim * e) if not self.fp8 else (self.head_dim, self.block_n),
                 (self.block_m, self.value_dim * 2))  # rows x bytes: Q, K, V (e4m3: transposed), O
        for rows, width in tiles:
            if rows * width // 16 % self.threads:
                raise ValueError(f"tile of {rows} rows x {width} bytes does not split evenly over "
                                 f"{self.threads} threads")

    def _check_fp8(self) -> None:
        """An e4m3 config: head dims 64, 128, 256 (V's the same); 32 keys a PV k-step, the transposed V
        tile's rows at least one 64-byte swizzle row; Q resident; O staged over the Q and K tiles
        (block_n >= block_m); none of the 16-bit knobs (their PV steps are 16 keys)."""
        if self.head_dim not in (64, 128, 256) or self.head_dim_v:
            raise ValueError(f"an e4m3 config needs head_dim 64, 128 or 256 (V's the same), got {self}")
        if self.block_n % 64 or self.block_n < self.block_m or not self.q_in_regs:
            raise ValueError("an e4m3 config needs block_n a multiple of 64 and >= block_m (O is staged "
                             f"over the Q and K tiles) and Q in registers, got {self}")
        if self.double_buffer or self.early_k or self.interleave_pv:
            raise ValueError(f"an e4m3 config takes no double_buffer, early_k or interleave_pv, got {self}")


# The (Q's and K's, V's) head dims the Hopper forward takes apart (``WsConfig.head_dim_v``): both
# multiples of 64 (one swizzle, 128-byte rows), O and V no wider than Q and K (O fits where Q sits).
WS_VALUE_DIMS = ((192, 128),)


@dataclasses.dataclass(frozen=True)
class WsConfig(ValueDim):
    """Compile-time shape of the warp-specialised Hopper kernel (``forward_ws``): one producer
    warpgroup (TMA) and ``consumers`` warpgroups of 64 query rows (wgmma)."""

    head_dim: int
    block_n: int = 128  # keys per KV tile
    stages: int = 2  # K and V ring depth
    # Consumer warpgroups: 2 (128 query rows, 240 registers each) or 3 (192 rows, 160 each:
    # head dim 64 only, where O is 32 registers and one more warpgroup hides the softmax).
    consumers: int = 2
    pingpong: bool = False  # consumer warpgroups take turns issuing GEMMs (named barriers)
    q_stages: int = 2  # Q buffers: 2 lets the producer load the next tile's Q during this one
    # Stage O for its TMA store in the Q buffer (each warpgroup over its own Q rows) instead of
    # a tile of its own: what makes d256 fit (Q 64 KB + 2 x 2 x 40 KB); the next Q then waits
    # until the store has read the buffer. Needs q_stages 1.
    o_in_q: bool = False
    # Stage O for its TMA store at the start of the V ring instead of a tile of its own
    # (FlashAttention-3's arrangement): the consumers first wait until every warpgroup has
    # finished reading V, and the producer loads the next tile's V only once the store has read
    # O. Unlike o_in_q it leaves Q free, so the next tile's Q can land during this tile's last
    # softmax, PV and epilogue. Two consumers only (a warpgroup passing over a tile would
    # have to join the wait). The 128 O rows fit in any V ring (at least 2 stages of 64 keys).
    o_in_v: bool = False
    # V's (and O's) head dim where it differs from ``head_dim`` (Q's and K's): 0 for the same
    # (``ForwardConfig.head_dim_v``; ``WS_VALUE_DIMS`` lists the pairs). A shape of the call, not a knob.
    head_dim_v: int = 0
    # Pin the wait that retires a tile's PV product below the next tile's exponentials (a CTA
    # fence, ``ptx.hopper.fence_acq_rel_cta_after``, which ptxas does not hoist a wgmma wait
    # above): without it ptxas hoists the wait above them, so the softmax's exponentials run after
    # PV rather than beside it. ptxas may hoist the fence with it where nothing orders the two
    # (the 16-bit head-dim-64 causal build); tests/test_ws_inspect_offline.py checks the shipped
    # build. H200: e4m3 head dim 64 causal +3% (4k) and +10% (16k), full 0 to -1%; 16-bit head
    # dims 64 and 128 and e4m3 128 tie or lose (docs/PERFORMANCE.md [WAITPOS]).
    late_pv_wait: bool = False
    # q, k and v in e4m3 (one byte an element), O in 16 bits: S and PV as m64nNk32 wgmma, whose
    # 8-bit operands are K-major only, so V arrives transposed, (batch, heads_kv, head_dim, keys)
    # with its keys in ``fp8_layout.KEY_ORDER`` within each 32. A dtype of the call, not a knob.
    fp8: bool = False

    @property
    def block_m(self) -> int:
        return WARPGROUP_ROWS * self.consumers

    @property
    def element_bytes(self) -> int:
        """Bytes of one q, k or v element: 1 (e4m3) or 2."""
        return 1 if self.fp8 else 2

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after ``setmaxnreg``; together they use
        the 64K registers of an SM: 24 x 128 + 240 x 256, or 32 x 128 + 160 x 384."""
        return (24, 240) if self.consumers == 2 else (32, 160)

    def first_block_lead(self, seqlen_q: int) -> int:
        """Rows the first query block starts before row 0 (whole warpgroups), so that the
        blocks end at ``seqlen_q`` and a ragged block is the first: with causal masking the
        lightest, not the heaviest. Three consumers only (their causal kernels skip the
        warpgroups that hold no row, ``forward_ws.skip_tiles``); the kernel reads it only
        when causal. The block count stays ``ceil(seqlen_q / block_m)``."""
        rows = WARPGROUP_ROWS
        return (-seqlen_q % self.block_m) // rows * rows if self.consumers == 3 else 0

    @property
    def row_bytes(self) -> int:
        """Bytes per row of one swizzle block (and TMA box) of Q and K (16-bit: of V too): 128
        (128B swizzle) where 128 divides a row's bytes, else 64 (64B swizzle: head dim 96, and
        e4m3 head dim 64)."""
        return 128 if (self.head_dim * self.element_bytes) % 128 == 0 else 64

    @property
    def box_cols(self) -> int:
        """Head-dim columns of one TMA box (one swizzle block) of Q and K."""
        return self.row_bytes // self.element_bytes

    @property
    def o_row_bytes(self) -> int:
        """Bytes per row of one swizzle block of the 16-bit O tile (128B swizzle where 64 divides
        O's columns, else 64B): ``row_bytes`` but for e4m3 kernels."""
        return 128 if self.value_dim % 64 == 0 else 64

    @property
    def o_box_cols(self) -> int:
        """O's columns in one TMA box (one swizzle block of the O tile)."""
        return self.o_row_bytes // 2

    @property
    def vt_row_bytes(self) -> int:
        """e4m3: bytes (keys) per row of one swizzle block of the transposed V tile (head-dim
        rows of ``block_n`` keys): 128 where 128 divides block_n, else 64."""
        return 128 if self.block_n % 128 == 0 else 64

    @property
    def tile_bytes(self) -> dict[str, int]:
        """Bytes of one Q buffer, K stage and V stage, and of the O tile (0 when O is staged in the
        Q buffer or V ring); V and O have ``value_dim`` columns, O 16 bits whatever the input."""
        e = self.element_bytes
        return {"q": self.block_m * self.head_dim * e, "k": self.block_n * self.head_dim * e,
                "v": self.block_n * self.value_dim * e,
                "o": 0 if self.o_in_q or self.o_in_v else self.block_m * self.value_dim * 2}

    @property
    def shared_layout(self) -> SharedLayout:
        """Where the tiles sit (the kernel and ``shared_bytes`` both read this)."""
        t = self.tile_bytes
        k = self.q_stages * t["q"]
        v = k + self.stages * t["k"]
        v_end = v + self.stages * t["v"]
        o = v if self.o_in_v else v_end
        return SharedLayout(q=0, k=k, v=v, o=o, end=v_end + t["o"])

    @property
    def barrier_layout(self) -> BarrierLayout:
        """Where the mbarriers sit: the Q ring's ``q_stages`` full then empty barriers, the
        K and V rings' ``stages`` each, then O empty."""
        q_ring = self.q_stages * MBARRIER_BYTES
        kv_ring = self.stages * MBARRIER_BYTES
        k_full = 2 * q_ring
        o_empty = k_full + 4 * kv_ring
        return BarrierLayout(q_full=0, q_empty=q_ring, k_full=k_full, k_empty=k_full + kv_ring,
                             v_full=k_full + 2 * kv_ring, v_empty=k_full + 3 * kv_ring, o_empty=o_empty,
                             words=o_empty // MBARRIER_BYTES + 1)

    @property
    def shared_bytes(self) -> int:
        """The Q buffers, the K and V rings and the O staging tile, plus 1 KB to align the base."""
        return self.shared_layout.end + SMEM_ALIGN

    def check(self) -> None:
        if self.head_dim_v:
            if (self.head_dim, self.head_dim_v) not in WS_VALUE_DIMS:
                raise ValueError(f"(head_dim, head_dim_v) must be one of {WS_VALUE_DIMS}, got "
                                 f"({self.head_dim}, {self.head_dim_v})")
        elif self.head_dim not in (64, 96, 128, 256):
            raise ValueError(f"head_dim must be 64, 96, 128 or 256, got {self.head_dim}")
        if self.block_n not in (64, 80, 128, 176, 192):  # a bound wgmma N (ptx/wgmma.cu), 16 keys a k-step
            raise ValueError(f"block_n must be 64, 80, 128, 176 or 192, got {self.block_n}")
        if self.consumers not in (2, 3):
            raise ValueError(f"consumers must be 2 or 3, got {self.consumers}")
        if self.fp8 and (self.head_dim not in (64, 128, 256) or self.head_dim_v or self.block_n % 64
                         or self.o_in_q or self.o_in_v):
            raise ValueError("an e4m3 kernel needs head_dim 64, 128 or 256 (V's the same), block_n a "
                             "multiple of 64 (the transposed V's swizzle) and O in a tile of its own, "
                             f"got {self}")
        if self.consumers == 3 and (self.head_dim != 64 or self.block_n > 128):
            raise ValueError("3 consumers (160 registers each) need head_dim 64 and block_n <= 128 "
                             f"(O, S and P of a warpgroup must fit), got {self}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages must be 2..4, got {self.stages}")
        if self.q_stages not in (1, 2):
            raise ValueError(f"q_stages must be 1 or 2, got {self.q_stages}")
        if self.o_in_q and self.q_stages != 1:
            raise ValueError("o_in_q needs q_stages 1 (the O rows overwrite the Q buffer being used)")
        if self.o_in_v and (self.o_in_q or self.consumers != 2):
            raise ValueError(f"o_in_v needs 2 consumers and not o_in_q, got {self}")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes} bytes of shared memory (> 227 KB)")


def block_columns(config: WsConfig | WsBackwardConfig, row_bytes: int = 0) -> int:
    """Head-dim columns of one swizzle block (and TMA box) whose rows are ``row_bytes`` bytes (0:
    the config's ``row_bytes``): 64 in 128-byte rows of 16-bit values, 32 in 64-byte rows (head dim
    96, the pair's K in the unswapped backward tile, ``WsBackwardConfig.k_row_bytes``), 64 in the
    64-byte rows of e4m3 at head dim 64. The kernel's
    tile loads and the launch's tensor maps read it here, so that their boxes agree."""
    return config.box_cols * (row_bytes or config.row_bytes) // config.row_bytes


PREP_ROWS = 64  # query rows per CTA of the backward's prepare kernel
PREP_THREADS = 128  # threads per CTA of the prepare kernel


def prep_split(head_dim: int) -> tuple[int, int, int]:
    """How the backward's prepare kernel splits a query row of ``head_dim`` 16-bit values over its
    threads: (threads per row, 16-byte chunks per thread, rows per pass of ``PREP_THREADS``).
    The threads of a row are a power of two (a shuffle tree sums their parts), the largest that
    divides the row's chunks, at most 32; a pass's rows divide ``PREP_ROWS``."""
    chunks = head_dim // 8
    per_row = min(chunks & -chunks, 32)
    return per_row, chunks // per_row, PREP_THREADS // per_row


@dataclasses.dataclass(frozen=True)
class BackwardConfig(ValueDim):
    """Compile-time shape of the mma.sync backward (``backward_mma``, FlashAttention-2's
    algorithm): one CTA per block of ``block_n`` keys of one (batch, kv head) keeps that block's
    dK and dV in registers and walks the query blocks of ``block_m`` rows (of every query head of
    its group) that see it.

    The warps split each of the kernel's three products their own way (``num_warps`` = rows x
    columns in each): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ by ``key_warps`` x ``col_warps`` (keys x queries);
    dV += Pᵀ dO and dK += dSᵀ Q by ``key_warps`` x ``col_warps`` (keys x head-dim columns);
    dQ = dS K by ``dq_row_warps`` x ``dq_col_warps`` (queries x head-dim columns). Pᵀ and dSᵀ go
    through shared memory as 16-bit tiles between the first and the other two."""

    head_dim: int
    block_m: int = 64  # query rows per step of the walk
    block_n: int = 128  # keys per CTA
    num_warps: ClassVar[int] = 8  # not a knob: every shipped and tuned config has 8
    # Buffers of Q, dO and their rows' LSE and D: 2 loads the next query block during this one.
    q_stages: int = 2
    # 16-key m-tiles a warp owns in Sᵀ, dPᵀ, dK and dV (2: the warps of a key row then split the
    # queries and head-dim columns two ways, and each fragment loaded serves twice the mma.sync).
    key_tiles: int = 1
    # 16-query m-tiles a warp owns in dQ (2: the warps split the head-dim columns more ways).
    dq_tiles: int = 1
    # dQ accumulator floats a thread adds with one instruction: 1 (``red.global.add.f32``, every
    # GPU) or 4 (``red.global.add.v4.f32``, sm_90 on). Not a tuning knob: the compile target
    # sets it (``configs.backward_for_target``), and it sets the accumulator's order
    # (``dq_offset``).
    dq_vector: int = 1
    # V's (and dO's, O's, dV's) head dim where it differs from ``head_dim`` (Q's, K's, dQ's, dK's):
    # 0 for the same (``ForwardConfig.head_dim_v``). A shape of the call, not a knob.
    head_dim_v: int = 0
    # The dQ accumulator's order is that of dQᵀ (``dq_position``): set only on the prepare and dQ
    # kernels' config of a Hopper backward whose query blocks are not whole wgmma m-tiles
    # (``WsBackwardConfig.dq_config``, block_m 80). No mma.sync main kernel is built with it.
    dq_transposed: bool = False

    @property
    def tag(self) -> str:
        return (f"_w{self.num_warps}" + ("_s1" if self.q_stages == 1 else "")
                + (f"_k{self.key_tiles}" if self.key_tiles != 1 else "")
                + (f"_q{self.dq_tiles}" if self.dq_tiles != 1 else "")
                + (f"_v{self.dq_vector}" if self.dq_vector != 1 else "")
                + ("_t" if self.dq_transposed else ""))

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def key_warps(self) -> int:
        """Warps along the keys in the S/dP and dK/dV products (16 keys or more each)."""
        return min(self.num_warps, self.block_n // (16 * self.key_tiles))

    @property
    def col_warps(self) -> int:
        """Warps that share a key row: they split the queries of Sᵀ and dPᵀ and the head-dim
        columns of dK and dV."""
        return self.num_warps // self.key_warps

    @property
    def dq_row_warps(self) -> int:
        return min(self.num_warps, self.block_m // (16 * self.dq_tiles))

    @property
    def dq_col_warps(self) -> int:
        return self.num_warps // self.dq_row_warps

    @property
    def row_bytes(self) -> int:
        """Bytes per row of a swizzle block of the Q, K, V and dO tiles (``smem``)."""
        return 128 if self.head_dim % 64 == 0 else 64

    @property
    def dq_fragment_elements(self) -> int:
        """dQ accumulator elements each thread holds for one query block (``dq_position``)."""
        return self.block_m * self.head_dim // self.threads

    def dq_position(self, tid: int, i: int) -> tuple[int, int]:
        """(row, column) in a query block of dQ of element ``i`` of thread ``tid``'s accumulator
        fragment in the main kernel's dQ product (an m16n8k16 C fragment: ``i`` = 4 (m-tile x
        n-tiles + n-tile) + 2 (row half) + column pair element).

        The dQ accumulator stores a query block's ``block_m x head_dim`` floats in fragment
        order (``dq_offset``), where the row-major order would have a warp's add touch 8 rows.
        The dQ kernel reads it back with this map, which is a bijection onto the block
        (``tests/test_backward_api_cpu.py``)."""
        warp, lane = divmod(tid, 32)
        if self.dq_transposed:  # a wgmma dQᵀ fragment: warp w's 16 rows are head-dim columns 16 w ..
            j, e = divmod(i, 4)
            return 8 * j + 2 * (lane % 4) + e % 2, 16 * warp + lane // 4 + 8 * (e // 2)
        n_tiles = self.head_dim // self.dq_col_warps // 8
        tile, e = divmod(i, 4)
        mt, j = divmod(tile, n_tiles)
        row0 = (warp % self.dq_row_warps) * 16 * self.dq_tiles
        col0 = (warp // self.dq_row_warps) * (self.head_dim // self.dq_col_warps)
        return row0 + 16 * mt + lane // 4 + 8 * (e // 2), col0 + 8 * j + 2 * (lane % 4) + e % 2

    def dq_offset(self, tid: int, i: int) -> int:
        """Offset in a query block's dQ accumulator (float32 elements) of element ``i`` of
        thread ``tid``'s fragment (``dq_position``): ``i * threads + tid`` with ``dq_vector``
        1, so that a warp's ``red.global.add.f32`` of one ``i`` covers one 128-byte line; with
        ``dq_vector`` 4 the thread's four floats of an n-tile are adjacent, ``4 (i // 4) threads
        + 4 tid + i % 4``, so that a warp's ``red.global.add.v4.f32`` covers four whole lines.
        A bijection onto ``range(block_m * head_dim)`` (``tests/test_backward_api_cpu.py``)."""
        if self.dq_vector == 1:
            return i * self.threads + tid
        return (i // 4) * 4 * self.threads + 4 * tid + i % 4

    @property
    def shared_layout(self) -> dict[str, int]:
        """Byte offsets of the shared tiles: K, V (``block_n`` rows), the Pᵀ and dSᵀ tiles
        (``block_n`` rows of ``block_m`` 16-bit columns), then per stage Q and dO (``block_m``
        rows) and the stage's LSE and D rows (float32); ``end``: the bytes used."""
        d, dv, bm, bn = self.head_dim, self.value_dim, self.block_m, self.block_n
        k = 0
        v = k + bn * d * 2
        p = v + bn * dv * 2
        ds = p + bn * bm * 2
        q = ds + bn * bm * 2
        rows = q + bm * (d + dv) * 2  # the stage's LSE and D rows, after Q and dO
        stage = bm * (d + dv) * 2 + 2 * bm * 4  # Q, dO, LSE, D
        return {"k": k, "v": v, "p": p, "ds": ds, "q": q, "do": q + bm * d * 2,
                "lse": rows, "delta": rows + bm * 4, "stage": stage,
                "end": q + self.q_stages * stage}

    @property
    def shared_bytes(self) -> int:
        return self.shared_layout["end"]

    def check(self) -> None:
        d = self.head_dim
        if not (d == WIDE_HEAD_DIM and 0 < self.head_dim_v <= 256) and (d % 32 or not 32 <= d <= 256):
            raise ValueError(f"head_dim must be a multiple of 32 from 32 to 256 (or {WIDE_HEAD_DIM} with "
                             f"head_dim_v at most 256), got {d}")
        if self.dq_transposed:
            if (d, self.block_m, self.dq_vector, self.value_dim) != (128, 80, 4, 128):
                raise ValueError(f"dq_transposed is the dQ order of the Hopper backward's 80-row query "
                                 f"blocks: head_dim 128, block_m 80, dq_vector 4, got {self}")
            return
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128 (whole 128-byte rows of the Pᵀ tile), got {self}")
        if self.key_tiles not in (1, 2) or self.dq_tiles not in (1, 2):
            raise ValueError(f"key_tiles and dq_tiles must be 1 or 2, got {self}")
        if self.block_n % (16 * self.key_warps) or self.block_n > 128 or self.num_warps % self.key_warps:
            raise ValueError(f"block_n must be a multiple of 16 x key warps, at most 128, got {self}")
        if self.block_m % (16 * self.dq_row_warps) or self.num_warps % self.dq_row_warps:
            raise ValueError(f"block_m must split into whole dQ m-tiles over the warps, got {self}")
        if self.q_stages not in (1, 2):
            raise ValueError(f"q_stages must be 1 or 2, got {self}")
        if self.dq_vector not in (1, 4):
            raise ValueError(f"dq_vector must be 1 or 4, got {self}")
        dv = self.value_dim
        if self.head_dim_v and (dv % 32 or not 32 <= dv <= d or (d % 64 == 0) != (dv % 64 == 0)):
            raise ValueError(f"head_dim_v must be a multiple of 32 up to head_dim ({d}), a multiple of 64 "
                             f"where head_dim is one (one swizzle), got {self}")
        for what, n, split in (("queries", self.block_m, self.col_warps), ("head_dim", d, self.col_warps),
                               ("head_dim_v", dv, self.col_warps), ("dq head_dim", d, self.dq_col_warps)):
            if n % (16 * split):
                raise ValueError(f"{what} ({n}) must split into multiples of 16 over {split} warps: {self}")
        block_chunks = self.row_bytes // 16
        if self.threads // block_chunks % 8:
            raise ValueError(f"{self.threads} threads do not copy whole 8-row swizzle groups")
        for rows in (self.block_m, self.block_n):
            for width in (d, dv):
                if rows * width // 8 % self.threads:
                    raise ValueError(f"tile of {rows} rows x {width} does not split evenly over "
                                     f"{self.threads} threads")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes} bytes of shared memory (> 227 KB)")


class WsBackwardLayout(NamedTuple):
    """Byte offsets of the Hopper backward's shared tiles from the aligned base: K and V (the
    CTA's key block), the ring stages of Q and dO, the two dSᵀ buffers, the two buffers of the
    query rows' LSE and D (written by the consumers, by step parity). The mbarriers are not here:
    they are a static array of ``WsBackwardConfig.barrier_words`` words (the K/V barrier, the
    ring's full then empty barriers)."""

    k: int
    v: int
    q: int  # stage s at q + s * q_stage
    do: int  # stage s at do + s * do_stage
    lse: int  # buffer b (step parity) at lse + b * rows_stage
    delta: int
    ds: int  # buffer b at ds + b * ds_bytes
    q_stage: int
    rows_stage: int
    ds_bytes: int
    end: int
    # The unswapped tile's (``WsBackwardConfig.swapped`` False) P buffers, buffer b at p + b *
    # ds_bytes (0 in the swapped tile, whose Pᵀ stays in registers); dO's stage bytes (Q's where
    # the head dims are equal).
    p: int = 0
    do_stage: int = 0
    # The unswapped tile's (``WsBackwardConfig.swapped`` False): a query block's float32 dQ (block_m x
    # head_dim), staged for the bulk reduce, then 16 bytes whose first word is the step's turn
    # (deterministic mode); 0 in the swapped tile
    dq: int = 0


@dataclasses.dataclass(frozen=True)
class WsBackwardConfig(ValueDim):
    """Compile-time shape of the warp-specialised Hopper backward (``backward_ws``): one CTA per
    block of ``block_n`` keys of one (batch, kv head) keeps dK and dV of the block in registers
    while a producer warp streams the ``block_m``-row query blocks that see it (Q and dO) through
    a ring of ``stages``; the consumers stage the blocks' LSE and D themselves.

    Two tiles (``swapped``): at head dims 64 and 128 two consumer warpgroups of 64 keys each
    compute Sᵀ and dPᵀ (keys as wgmma's M) and hold their keys' dK and dV rows; at (192, 128)
    FlashAttention-4's tile for the pair (``backward_ws_rows``): two warpgroups of 48 keys each
    compute S and dP (queries as M) and hold their keys' dKᵀ and dVᵀ over the whole head dims
    (the head dim as M); dQ is staged in shared memory and added by a bulk reduce.

    The dQ accumulator's order and the prepare and dQ kernels are the mma.sync backward's, for
    the equivalent ``BackwardConfig`` (``dq_config``): the consumer warps hold dQ as that config's
    warps do (the unswapped tile maps its fragments there: ``dq_add_at``)."""

    head_dim: int
    block_m: int = 64  # query rows per step of the walk (the N of Sᵀ and dPᵀ, the K of dV and dK)
    # Where a step stages the next step's LSE and D rows (cp.async): before the step's Sᵀ and dPᵀ
    # (False), or once both are issued (True). The staging waits on the LSU, which the last step's
    # dQ adds (eight RED.128 a thread) still hold; issued after them, Sᵀ runs meanwhile. Measured
    # on an H200: d128 +1.1% to +3.5%, d64 -1% (docs/PERFORMANCE.md [BWL]).
    late_rows: bool = False
    # Pᵀ = exp2(Sᵀ·scale − LSE₂) in place between Sᵀ's wait and dPᵀ's, the wait kept below the
    # exponentials by a CTA fence (``ptx.hopper.fence_acq_rel_cta_after``), so that they run beside
    # dPᵀ's GEMM (FlashAttention-3's order; dV still issued after dSᵀ). Swapped tile, not in softcap
    # builds (they need the capped score after P is made). Measured on an H200, bf16: d64 +0.2% to
    # +4% (1k-16k); d128 -3% (64 rows) and -23% (80 rows: ptxas serialises every wgmma)
    # (docs/PERFORMANCE.md [EARLYP]).
    early_p: bool = False
    # V's (and dO's, dV's) head dim where it differs from ``head_dim`` (Q's, K's, dQ's, dK's): 0 for
    # the same (``BackwardConfig.head_dim_v``). A shape of the call, not a knob: (192, 128) only.
    head_dim_v: int = 0
    # Not a knob: every shipped and tuned config has a ring of 2.
    stages: ClassVar[int] = 2  # Q / dO ring depth

    @property
    def swapped(self) -> bool:
        """Whether S and dP are computed transposed (Sᵀ = K Qᵀ: each consumer warpgroup owns 64 keys
        and holds their dK and dV rows over the whole head dim): every head dim but 192, whose dK
        rows (96 floats a thread) beside dV's and Sᵀ's and dPᵀ's would need 224 registers."""
        return self.head_dim != 192

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: 2 (swapped: 64 keys each; unswapped: 48 keys each)."""
        return 2

    @property
    def block_n(self) -> int:
        return WARPGROUP_ROWS * self.consumers if self.swapped else 96

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after ``setmaxnreg``: 24 x 128 + 240 x 256, the
        168 x 384 a CTA of launch_bounds (384, 1) is given (more would never be granted)."""
        return (24, 240)

    @property
    def row_bytes(self) -> int:
        return 128

    @property
    def box_cols(self) -> int:
        return 64

    @property
    def k_row_bytes(self) -> int:
        """Bytes of a row of one swizzle block of K's tile: 128 (64 columns, 128B swizzle), but 64
        (32 columns, 64B swizzle) in the unswapped tile. There each warpgroup's dQ = dS K takes 96 of
        K's head-dim columns as its B (MN-major), which in 32-column blocks is one m64n96 wgmma a
        k-step (FlashAttention-4's layout for the pair); 64-column blocks need an m64n64 and an
        m64n32 that read dS twice (5% more shared-memory traffic at 16k causal, [SW64K])."""
        return 128 if self.swapped else 64

    @property
    def dq_split(self) -> str:
        """How the consumer warpgroups split dQ = dS K: by rows ("m": 64 query rows each, when
        block_m = 64 x consumers) or by head-dim columns ("n": block_m = 64); or, where block_m is
        not a whole wgmma m-tile (80), they compute dQᵀ = Kᵀ dSᵀ, 64 head-dim columns each ("t")."""
        if self.block_m % WARPGROUP_ROWS:
            return "t"
        return "m" if self.block_m == WARPGROUP_ROWS * self.consumers else "n"

    @property
    def tag(self) -> str:
        return f"_s{self.stages}" + ("_lr" if self.late_rows else "") + ("_ep" if self.early_p else "") + (
            f"_v{self.head_dim_v}" if self.head_dim_v else "")

    def dq_config(self) -> BackwardConfig:
        """The mma.sync config whose dQ fragment order (``BackwardConfig.dq_position``) this
        kernel's consumer warps add in, and whose prepare and dQ kernels it shares (the unswapped
        tile: the pair's mma.sync config of 64-key blocks, whose order ``dq_add_at`` maps onto)."""
        return BackwardConfig(self.head_dim, block_m=self.block_m,
                              block_n=self.block_n if self.swapped else 64, dq_vector=4,
                              head_dim_v=self.head_dim_v, dq_transposed=self.dq_split == "t")

    def dq_add_at(self, wg: int, warp: int, lane: int, j: int) -> int:
        """The unswapped tile: the offset (float32 elements) in a query block's dQ accumulator of
        the four floats of n-tile ``j`` (columns 96 wg + 8 j ..) that lane ``lane`` of warp ``warp``
        of consumer warpgroup ``wg`` adds (rows 16 warp + lane // 4 and + 8), in ``dq_config``'s
        order: its warps 4 h .. 4 h + 3 hold columns 96 h .. (h = the column half), 12 n-tiles
        each. The kernel computes the same (``backward_ws_rows``); the map onto ``dq_position`` is
        checked on the CPU (``tests/test_backward_ws_rows_cpu.py``). Warpgroup ``wg`` holds column
        half wg (j < 12), so the offset is 4 (256 j + thread), thread = 128 wg + 32 warp + lane."""
        return 4 * (256 * j + 128 * wg + 32 * warp + lane)

    @property
    def layout(self) -> WsBackwardLayout:
        d, dv, bm, bn = self.head_dim, self.value_dim, self.block_m, self.block_n
        q_stage = bm * d * 2
        do_stage = bm * dv * 2
        rows_stage = bm * 4
        if self.swapped:
            ds_bytes = bn * 128 * -(-bm // 64)  # dSᵀ: whole 128-byte column blocks of 64 queries
            p_buffers = 0
        else:  # P and dS: block_m query rows of whole 128-byte column blocks of 64 keys
            ds_bytes = bm * 128 * -(-bn // 64)
            p_buffers = 1  # one buffer of each: room for the staged dQ
        ds_buffers = 2 if self.swapped else 1
        k = 0
        v = k + bn * d * 2
        q = v + bn * dv * 2
        do = q + self.stages * q_stage
        ds = do + self.stages * do_stage
        p = ds + ds_buffers * ds_bytes
        dq = p + p_buffers * ds_bytes
        lse = dq + (bm * d * 4 + 16 if not self.swapped else 0)  # and the step's turn (a word)
        delta = lse + 2 * rows_stage
        end = delta + 2 * rows_stage
        return WsBackwardLayout(k, v, q, do, lse, delta, ds, q_stage, rows_stage, ds_bytes, end,
                                p if p_buffers else 0, do_stage, dq if not self.swapped else 0)

    @property
    def step_bytes(self) -> int:
        """Bytes one ring stage receives: Q and dO."""
        return self.layout.q_stage + self.layout.do_stage

    @property
    def barrier_words(self) -> int:
        """The K/V barrier, the ring's full and empty barriers, and (unswapped) the staged dQ's."""
        return 1 + 2 * self.stages + (2 if not self.swapped else 0)

    @property
    def shared_bytes(self) -> int:
        """The tiles, plus 1 KB to align the base (the mbarriers are a static array)."""
        return self.layout.end + SMEM_ALIGN

    def check(self) -> None:
        if not self.swapped:
            if (self.value_dim, self.block_m, self.late_rows) != (128, 64, False):
                raise ValueError(f"head_dim 192 is the unswapped tile of head_dim_v 128, block_m 64, "
                                 f"late_rows False, got {self}")
        elif self.head_dim not in (64, 128) or self.head_dim_v:
            raise ValueError(f"head_dim must be 64 or 128 (or 192 with head_dim_v 128), got {self}")
        if self.early_p and not self.swapped:
            raise ValueError(f"early_p needs the swapped tile (head dims 64 and 128), got {self}")
        if self.block_m not in (64, 80, 128):
            raise ValueError(f"block_m must be 64, 80 or 128, got {self.block_m}")
        if self.block_m == 80 and self.head_dim != 128:
            raise ValueError(f"block_m 80 (dQ transposed) needs head_dim 128, got {self}")
        if self.block_m == 64 and self.swapped and self.head_dim % (64 * self.consumers):
            raise ValueError(f"block_m 64 splits dQ's head-dim columns over the consumers in 64-column "
                             f"blocks: head_dim must be a multiple of {64 * self.consumers}, got {self}")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes} bytes of shared memory (> 227 KB)")


class PackedRows:
    """What the decode configs share (``DecodeConfig``, ``MlaDecodeConfig``, ``WsMlaConfig``): a CTA's
    packed query rows, ``m_tiles`` 16-row m-tiles, and its threads, ``num_warps`` warps."""

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


@dataclasses.dataclass(frozen=True)
class DecodeConfig(ValueDim, PackedRows):
    """Compile-time shape of the decode kernel (``decode_mma``): one CTA takes
    ``rows`` packed query rows (the query heads of one KV head times seqlen_q) and one split of
    the keys; ``block_n`` keys a tile stream through a ring of ``stages`` K and V tiles, and each
    of the ``num_warps`` warps takes ``block_n / num_warps`` keys of a tile."""

    head_dim: int
    block_n: int = 64
    num_warps: int = 4
    m_tiles: int = 1  # 16-row m-tiles of packed query rows (every warp computes all of them)
    stages: int = 3
    paged: bool = False  # K and V through a block table
    # V's (and O's) head dim where it differs from ``head_dim`` (Q's and K's): 0 for the same
    # (``ForwardConfig.head_dim_v``). A shape of the call, not a knob.
    head_dim_v: int = 0
    # Paged, and each tile's keys lie in one page (block_n divides the page size and a sequence's
    # key 0 is its first page's row 0: no cache_leftpad): the tile's page is looked up once, by
    # every thread, and copied as a contiguous cache's tile; else each key row's (``paged`` alone).
    page_tiles: bool = False

    @property
    def row_bytes(self) -> int:
        return 128 if self.head_dim % 64 == 0 else 64

    @property
    def tag(self) -> str:
        pages = "_pagetiles" if self.page_tiles else "_paged" if self.paged else ""
        return f"_w{self.num_warps}_s{self.stages}{pages}"

    @property
    def merge_row(self) -> int:
        """Floats from one O row to the next in the warps' merge: O's head dim + 8, which is 8 mod
        32 (head dims are multiples of 32), so a warp's stores of 8 rows spread over the banks."""
        return self.value_dim + 8

    @property
    def stage_bytes(self) -> int:
        """One stage of the ring: a K tile, then a V tile (``value_dim`` columns)."""
        return self.block_n * (self.head_dim + self.value_dim) * 2

    @property
    def bytes_in_flight(self) -> int:
        """K and V bytes a CTA has on the way while it computes a tile: the ring's other stages."""
        return (self.stages - 1) * self.stage_bytes

    @property
    def page_rows_at(self) -> int:
        """Paged: the byte offset of the key rows' cache offsets (two buffers, by tile parity, of
        ``block_n`` rows x (K's, V's) int64), after the Q tile and the ring (or the merge)."""
        q_tile = self.rows * self.head_dim * 2
        ring = self.stages * self.stage_bytes
        merge = self.num_warps * self.rows * (self.merge_row + 2) * 4
        return q_tile + max(ring, merge)

    @property
    def shared_bytes(self) -> int:
        """The Q tile and the K/V ring; the warps' merge (float32 O, m and l) reuses the ring;
        paged by rows, the key rows' cache offsets after them (``page_rows_at``)."""
        return self.page_rows_at + (2 * self.block_n * 16 if self.paged and not self.page_tiles else 0)

    def check(self) -> None:
        d, dv = self.head_dim, self.value_dim
        if self.page_tiles and not self.paged:
            raise ValueError(f"page_tiles needs a paged cache (paged=True), got {self}")
        if d % 32 or not 32 <= d <= 256:
            raise ValueError(f"head_dim must be a multiple of 32 from 32 to 256, got {d}")
        if dv % 32 or not 32 <= dv <= d or (dv % 64 == 0) != (d % 64 == 0):
            raise ValueError(f"head_dim_v must be a multiple of 32 from 32 to head_dim, and a multiple of 64 "
                             f"where head_dim is (one swizzle), got ({d}, {dv})")
        if self.num_warps not in (2, 4, 8) or self.block_n % (16 * self.num_warps):
            raise ValueError(f"block_n must split into 16-key slices over num_warps (2, 4 or 8), got {self}")
        if (self.block_n * d // 8) % self.threads:
            raise ValueError(f"a tile's 16-byte chunks must divide over the threads, got {self}")
        if self.m_tiles not in (1, 2) or not 2 <= self.stages <= 5:
            raise ValueError(f"m_tiles must be 1 or 2 and stages 2 to 5, got {self}")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes} bytes of shared memory (> 227 KB)")


class LatentTiles:
    """What the MLA configs share (``MlaDecodeConfig``, ``WsMlaConfig``): the Q tile of ``rows`` latent
    rows, then a ring of ``stages`` K tiles of ``block_n`` rows (V is a K tile's first ``value_dim``
    columns), in column blocks of 128-byte rows."""

    page_tiles = False  # a paged cache's rows are looked up one by one (``DecodeConfig.page_tiles``)

    @property
    def row_bytes(self) -> int:
        return 128

    @property
    def stage_bytes(self) -> int:
        """One stage of the ring: a K tile (V is its first ``value_dim`` columns)."""
        return self.block_n * self.head_dim * 2

    @property
    def bytes_in_flight(self) -> int:
        return (self.stages - 1) * self.stage_bytes

    @property
    def ring_at(self) -> int:
        return self.rows * self.head_dim * 2  # after the Q tile

    @property
    def p_at(self) -> int:
        """P's tile, after the ring (16-bit A fragments in the order each kernel's class names)."""
        return self.ring_at + self.stages * self.stage_bytes


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig(LatentTiles, ValueDim, PackedRows):
    """Compile-time shape of the MLA decode kernel (``mla_decode``, issue 58): DeepSeek's latent
    cache, one row a token of ``head_dim`` values (576: 512 latent + 64 rotary) shared by every
    query head, K the whole row and V its first ``head_dim_v`` (512). One CTA takes ``rows``
    packed query rows (query heads times seqlen_q) and one split of the keys; ``block_n``-key
    K tiles stream through a ring of ``stages`` (no V tile: PV reads K's first columns).

    O (rows x 512 float32) does not fit one warp's registers, so the warps split the two
    products differently: S = Q Kᵀ by ``key_warps`` key slices times ``num_warps / key_warps``
    m-tile groups, O by ``head_dim_v / num_warps`` columns a warp over every key of the tile,
    P and the row maxima passing through shared memory (P's tile, ``p_at``: 16-bit A fragments,
    [m-tile][16-key slice][lane] x 16 bytes)."""

    head_dim: int = 576
    head_dim_v: int = 512
    m_tiles: int = 1  # 16-row m-tiles of packed query rows a CTA
    block_n: int = 64  # keys a tile
    num_warps: int = 4
    key_warps: int = 4  # the S product's key slices (the warps' other factor splits the m-tiles)
    stages: int = 2
    paged: bool = False  # K through a block table

    @property
    def score_keys(self) -> int:
        """Keys of a tile one warp scores (its key slice)."""
        return self.block_n // self.key_warps

    @property
    def score_m_tiles(self) -> int:
        """m-tiles one warp scores (its m-tile group's)."""
        return self.m_tiles // (self.num_warps // self.key_warps)

    @property
    def value_columns(self) -> int:
        """O's columns one warp accumulates."""
        return self.value_dim // self.num_warps

    @property
    def tag(self) -> str:
        return (f"_m{self.rows}_n{self.block_n}_w{self.num_warps}k{self.key_warps}_s{self.stages}"
                + ("_paged" if self.paged else ""))

    @property
    def maxes_at(self) -> int:
        """The key slices' row maxima ([key_warps][rows] float32), then their row sums at the end."""
        return self.p_at + self.rows * self.block_n * 2

    @property
    def page_rows_at(self) -> int:
        """Paged: two buffers of the key rows' cache offsets (``decode_mma.make_page_table``)."""
        return self.maxes_at + self.key_warps * self.rows * 4

    @property
    def shared_bytes(self) -> int:
        return self.page_rows_at + (2 * self.block_n * 16 if self.paged else 0)

    def check(self) -> None:
        d, dv = self.head_dim, self.value_dim
        if d % 64 or dv % 64 or dv > d:
            raise ValueError(f"head_dim and head_dim_v must be multiples of 64, head_dim_v <= head_dim, "
                             f"got {self}")
        if (self.m_tiles not in (1, 2, 4) or self.num_warps not in (2, 4, 8)
                or self.key_warps not in (1, 2, 4, 8)):
            raise ValueError(f"m_tiles must be 1, 2 or 4, num_warps 2, 4 or 8, key_warps 1 to 8, got {self}")
        groups = self.num_warps // self.key_warps
        if self.num_warps % self.key_warps or self.m_tiles % groups:
            raise ValueError(f"key_warps must divide num_warps and the m-tile groups m_tiles, got {self}")
        if self.score_keys % 16 or self.value_columns % 64:
            raise ValueError(f"a warp scores a multiple of 16 keys and accumulates a multiple of 64 of O's "
                             f"columns, got {self}")
        if (self.block_n * d // 8) % self.threads or not 2 <= self.stages <= 4:
            raise ValueError(f"a tile's 16-byte chunks must divide over the threads, stages 2 to 4, "
                             f"got {self}")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes} bytes of shared memory (> 227 KB)")


@dataclasses.dataclass(frozen=True)
class WsMlaConfig(LatentTiles, ValueDim, PackedRows):
    """Compile-time shape of the Hopper MLA decode kernel (``mla_ws``, issue 58): wgmma on the latent
    cache. One CTA takes 64 packed query rows (query heads times seqlen_q) and one split of the
    keys, in two warpgroups that each keep half of O's columns (64 x 256 float32, 128 registers a
    thread) and take the split's ``block_n``-key tiles in turns: warpgroup w copies (cp.async, its
    128 threads; a paged cache through ``decode_mma.make_page_table``) and scores (S = Q Kᵀ, all 64
    rows) the tiles of stage w of a ring of ``stages`` = 2, laid out as the 128B-swizzle tiles
    wgmma's descriptors read; then both take O += P V over both tiles of the pair, V a K tile's
    first columns. The row maxima meet in the tile at ``p_at`` (as the row sums at the end); a
    tile's P goes across in its rotary columns."""

    head_dim: int = 576
    head_dim_v: int = 512
    block_n: int = 64  # keys a tile
    stages: int = 2
    paged: bool = False  # K through a block table
    m_tiles: ClassVar[int] = 4  # 64 rows: wgmma's M
    num_warps: ClassVar[int] = 8  # two warpgroups, each half of O's columns
    ALIGN: ClassVar[int] = 1024  # the 128B-swizzle atom: the tiles' base is aligned up to it

    @property
    def value_columns(self) -> int:
        """O's columns one warpgroup accumulates."""
        return self.value_dim // 2

    @property
    def tag(self) -> str:
        return f"_ws_n{self.block_n}_s{self.stages}" + ("_paged" if self.paged else "")

    @property
    def page_rows_at(self) -> int:
        """Paged: two buffers of the key rows' cache offsets (``decode_mma.make_page_table``), one a
        warpgroup."""
        return self.p_at + self.rows * self.block_n * 2

    @property
    def shared_bytes(self) -> int:
        return self.page_rows_at + (2 * self.block_n * 16 if self.paged else 0) + self.ALIGN

    def check(self) -> None:
        if (self.head_dim, self.value_dim) != (576, 512):
            raise ValueError(f"the Hopper MLA kernel takes head dims (576, 512), got {self}")
        if (self.block_n, self.stages) != (64, 2):
            raise ValueError(f"the Hopper MLA kernel takes 64-key tiles in a ring of 2 (a stage a "
                             f"warpgroup), got {self}")
        if self.shared_bytes > 227 * 1024:
            raise ValueError(f"{self} needs {self.shared_bytes} bytes of shared memory (> 227 KB)")
