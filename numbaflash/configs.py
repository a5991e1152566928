"""Kernel configurations per GPU family, head dim and causality.

sm80 family (Ampere, Ada, Blackwell, ...): the mma.sync kernel (``ForwardConfig``).
sm90 (Hopper): the warp-specialised TMA + wgmma kernel (``WsConfig``; an older cp.async wgmma
kernel was removed after it won no shape against the warp-specialised one); the mma.sync
kernel also runs there, and Hopper runs it for the head dims its own kernel does not support
(``FAMILY_HEAD_DIMS``, ``dispatch_family``): today 32.
The choice per (family, head dim, causal) is made by ``benchmarks/autotune.py`` and stored
in ``tuned_configs.json`` beside this file; entries missing from it use ``DEFAULTS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from .kernels.families import FAMILIES, SM80_BWD, SM90_BWD, family_of, family_of_table_kind
from .kernels.shapes import BackwardConfig, ForwardConfig, WsBackwardConfig, WsConfig
from .kernels.spec import KernelSpec

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
# (Q's and K's head dim, V's) pairs that differ, with a kernel: DeepSeek-V3-style (192, 128). Forward
# on both families (the Hopper kernel's defaults: ASYMMETRIC_WS_DEFAULTS), backward on the mma.sync
# family (every GPU from sm_80; no Hopper backward has head dim 192), decode. (512, 256): the
# mma.sync family's forward and backward, the halves of head dim 512 (``operations.head_dims``);
# no decode kernel (``DECODE_HEAD_DIM_PAIRS``).
ASYMMETRIC_HEAD_DIMS = ((192, 128), (512, 256))
# The pairs the KV-cache call (the decode kernel) takes.
DECODE_HEAD_DIM_PAIRS = ((192, 128),)
# Head dims each family's own kernel handles; a GPU whose family lacks one runs the sm80 family.
FAMILY_HEAD_DIMS = {"sm80": SUPPORTED_HEAD_DIMS, "sm90": (64, 96, 128, 256)}
TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
# Dynamic shared memory a CTA may opt in to, by compute capability (CUDA C++ Programming Guide,
# technical specifications per compute capability); any other sm_80+ GPU is assumed to have the
# least of them. The API asks the driver for the device's own value instead.
SMALLEST_SHARED_BYTES = 99 * 1024
MAX_SHARED_BYTES = {
    (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
    (9, 0): 227 * 1024, (10, 0): 227 * 1024, (12, 0): 99 * 1024,
}
KernelConfig = ForwardConfig | WsConfig

DEFAULTS: dict[tuple[str, int], KernelConfig] = {
    ("sm80", 64): ForwardConfig(64, block_m=128, block_n=64),
    ("sm80", 128): ForwardConfig(128, block_m=64, block_n=128),
    ("sm80", 32): ForwardConfig(32, block_m=128, block_n=128, warp_m_tiles=2),
    ("sm80", 96): ForwardConfig(96, block_m=64, block_n=128),
    # 96 KB of shared memory: fits every sm80-family GPU (sm_86/89/120 allow 99 KB a CTA), which
    # run it where the table's 128 x 64 (128 KB) does not fit (forward_config). FA2's choice
    # there too; on an H100 274 / 264 TFLOP/s full / causal against 242 / 231 for 128 x 32.
    ("sm80", 256): ForwardConfig(256, block_m=64, block_n=64, early_k=True),
    ("sm90", 64): WsConfig(64, block_n=192, stages=2, pingpong=True),
    ("sm90", 128): WsConfig(128, block_n=128, stages=2),
    ("sm90", 96): WsConfig(96, block_n=128, stages=2),
    # Q 64 KB + 2 stages of K and V at 64 rows (32 KB each): O is staged in the Q buffer.
    # (128 x 80 does not spill without causal masking: see the tuned table.)
    ("sm90", 256): WsConfig(256, block_n=64, stages=2, q_stages=1, o_in_q=True),
}
# The e4m3 (FP8) Hopper forward's config per head dim (``WsConfig.fp8``; ``operations.fp8_forward``),
# O always in a tile of its own (e4m3 tiles are half the bytes). Chosen on an H200 among 18 shapes
# (docs/PERFORMANCE.md, "The FP8 forward"): d128 192 keys a tile (3-12% over 128 at 4k and 16k);
# d256 one Q buffer (Q 32 KB, K and V 2 x 2 x 32 KB, O 64 KB) with ping-pong (5-9% at 4k, -2..0%
# at 16k); d64 the 16-bit table's three consumers, PV's wait pinned below the exponentials
# (``late_pv_wait``: causal +3-10%, full 0 to -1%).
# A ``ForwardConfig`` with ``fp8`` set in its place runs the mma.sync build on Hopper too (tests and
# tools).
FP8_DEFAULTS: dict[int, WsConfig | ForwardConfig] = {
    64: WsConfig(64, block_n=128, stages=2, consumers=3, late_pv_wait=True, fp8=True),
    128: WsConfig(128, block_n=192, stages=2, fp8=True),
    256: WsConfig(256, block_n=128, stages=2, q_stages=1, pingpong=True, fp8=True),
}
FP8_HEAD_DIMS = tuple(FP8_DEFAULTS)
# The e4m3 mma.sync forward (``ForwardConfig.fp8``: m16n8k32, sm_89 on) on every other FP8 GPU (Ada
# sm_89, Blackwell sm_100 and sm_120): FlashAttention-2's tile shapes with the tiles' bytes halved,
# 24-48 KB of shared memory (any sm_89+ GPU). Not tuned: no such GPU has measured them yet.
FP8_MMA_DEFAULTS: dict[int, ForwardConfig] = {
    64: ForwardConfig(64, block_m=128, block_n=128, fp8=True),
    128: ForwardConfig(128, block_m=128, block_n=128, fp8=True),
    256: ForwardConfig(256, block_m=64, block_n=64, fp8=True),
}


def fp8_config(capability: tuple[int, int], head_dim: int) -> WsConfig | ForwardConfig:
    """The e4m3 forward's config for ``head_dim`` on a GPU of ``capability``: the Hopper kernel's
    (``FP8_DEFAULTS``) on sm_90, the mma.sync kernel's (``FP8_MMA_DEFAULTS``) on the others."""
    return (FP8_DEFAULTS if arch_family(capability) == "sm90" else FP8_MMA_DEFAULTS)[head_dim]
# (head_dim, head_dim_v) pairs' forward config (``ASYMMETRIC_HEAD_DIMS``), on every GPU: d256's
# table shape (128 x 64, Q by k-slices, double buffered, early K copy) at Q's and K's 192 columns
# and V's 128: 88 KB of shared memory, which fits every sm80-family GPU. Not tuned yet.
ASYMMETRIC_DEFAULTS: dict[tuple[int, int], ForwardConfig] = {
    (192, 128): ForwardConfig(192, block_m=128, block_n=64, double_buffer=True, early_k=True, head_dim_v=128),
    # 128 x 64, early K copy, Q's and K's 512 columns: 224 KB (H100, H200, B200); 243-245 registers,
    # no spill offline. H200, head dim 512 at 4k: 211 / 199 TF/s full / causal against 190 / 180 for
    # 64 x 64 and 178 / 171 for 128 x 32 (docs/PERFORMANCE.md [D512]).
    (512, 256): ForwardConfig(512, block_m=128, block_n=64, early_k=True, head_dim_v=256),
}
# Where a pair's default does not fit a GPU's shared memory, the first of these that does: (512,
# 256) at 64 x 64 (160 KB: A100) and 64 x 16 (88 KB: sm_86, sm_89, sm_120).
ASYMMETRIC_FALLBACKS: dict[tuple[int, int], tuple[ForwardConfig, ...]] = {
    (512, 256): (ForwardConfig(512, block_m=64, block_n=64, early_k=True, head_dim_v=256),
                 ForwardConfig(512, block_m=64, block_n=16, early_k=True, head_dim_v=256)),
}
# The pairs' Hopper forward (sm90 family, dense and packed): d128's 128 x 128 tiles with Q's and
# K's 192 columns and V's 128. One Q buffer, K and V stages of 48 and 32 KB, O staged in the V
# ring (as FlashAttention-3): 208 KB (two Q buffers, or O in a tile of its own, pass 227).
# S, P and O are d128's registers; S's GEMM is 1.5x as deep. Not tuned yet.
ASYMMETRIC_WS_DEFAULTS: dict[tuple[int, int], WsConfig] = {
    (192, 128): WsConfig(192, block_n=128, stages=2, q_stages=1, o_in_v=True, head_dim_v=128),
}
# The pairs' backward configs (mma.sync family, every GPU; not tuned yet), the first that fits a
# GPU's shared memory: d256's default shape, 64 x 64, at Q's and K's 192 columns and V's 128 (137
# KB with two Q stages; one stage, 96.5 KB, where a CTA gets 99 KB). 128 keys a CTA spill (23
# LDL/STL offline).
ASYMMETRIC_BACKWARD_DEFAULTS: dict[tuple[int, int], tuple[BackwardConfig, ...]] = {
    (192, 128): (BackwardConfig(192, block_m=64, block_n=64, head_dim_v=128),
                 BackwardConfig(192, block_m=64, block_n=64, q_stages=1, head_dim_v=128)),
    # 32 keys a CTA, one Q stage, dQ's rows in 32-row m-tiles (dK 64 + dV 32 + dQ 64 floats a
    # thread; dQ in two column passes: 254 registers, no spill offline; 2 Q stages need 250 KB, and
    # dq_tiles=1 spills): 152.5 KB, so no GPU of 99 KB a CTA. Not tuned yet.
    (512, 256): (BackwardConfig(512, block_m=64, block_n=32, q_stages=1, dq_tiles=2, head_dim_v=256),),
}
# The pairs' Hopper backward (dense calls; packed ones run the mma.sync configs above): (192, 128)
# on FlashAttention-4's tile for the pair (``kernels.backward_ws_rows``: two consumer warpgroups of
# 48 keys each, 96 keys a CTA, S and dP by query rows, dQ staged and bulk-reduced; 222 KB). Every dense
# variant builds without a spill offline (sm_90a). H200, bf16, 4k and 16k: 402-461 TF/s,
# 1.02-1.05x FlashAttention-3's three-warpgroup tile it replaced, 1.06-1.50x cuDNN but 0.96x at 16k
# causal (docs/PERFORMANCE.md [B192], [OK192]).
ASYMMETRIC_BACKWARD_WS: dict[tuple[int, int], WsBackwardConfig] = {
    (192, 128): WsBackwardConfig(192, head_dim_v=128),
}
# What benchmarks/autotune.py tries, by family and head dim, as keyword configs.
# mma.sync knobs (issue 13): q_in_regs=False streams Q a k-slice at a time instead of holding
# it in registers, double_buffer double-buffers the shared-memory fragments in registers,
# early_k copies K_{j+1} right after S_j, interleave_pv interleaves the PV product with the
# softmax. Every shape of 2 m-tiles a warp here compiles spill-free (d128 at 4 warps only with
# Q by k-slices; there double buffering spills when causal and early_k at 128 x 64; d96 128 x 64
# likewise needs Q by k-slices, and 128 x 128 spills even then; d256 128 x 32 spills with double
# buffering). FlashAttention-2's own forward shapes: d64 128 x 128, d128 128 x 64, d96 128 x 64,
# 4 warps of 2 m-tiles; d256 128 x 64 over 8 warps (>= 112 KB of shared memory a CTA), else
# 64 x 64 over 4. Head dims above 128 always stream Q (ForwardConfig.__post_init__).
_F = ForwardConfig
_SM80_CANDIDATES = {
    64: [_F(64, block_n=128), _F(64), _F(64, block_m=64, block_n=128),
         _F(64, block_m=256, warp_m_tiles=2), _F(64, block_m=256, warp_m_tiles=2, double_buffer=True),
         _F(64, warp_m_tiles=2), _F(64, warp_m_tiles=2, double_buffer=True),
         _F(64, warp_m_tiles=2, q_in_regs=False), _F(64, warp_m_tiles=2, early_k=True),
         _F(64, warp_m_tiles=2, double_buffer=True, early_k=True),
         _F(64, block_n=128, warp_m_tiles=2, q_in_regs=False, double_buffer=True),
         _F(64, block_n=128, warp_m_tiles=2, q_in_regs=False, double_buffer=True, interleave_pv=True),
         _F(64, warp_m_tiles=2, double_buffer=True, interleave_pv=True)],
    128: [_F(128), _F(128, block_n=32), _F(128, block_m=64, block_n=128),
          _F(128, warp_m_tiles=2, q_in_regs=False),
          _F(128, warp_m_tiles=2, q_in_regs=False, double_buffer=True),
          _F(128, warp_m_tiles=2, q_in_regs=False, early_k=True),
          _F(128, warp_m_tiles=2, q_in_regs=False, double_buffer=True, early_k=True),
          _F(128, warp_m_tiles=2, q_in_regs=False, interleave_pv=True),
          _F(128, warp_m_tiles=2, q_in_regs=False, double_buffer=True, interleave_pv=True),
          _F(128, block_n=32, warp_m_tiles=2, q_in_regs=False),
          _F(128, block_m=256, warp_m_tiles=2, q_in_regs=False)],
    32: [_F(32, block_n=128), _F(32), _F(32, block_m=64, block_n=128), _F(32, block_n=128, warp_m_tiles=2),
         _F(32, block_n=128, warp_m_tiles=2, double_buffer=True),
         _F(32, block_n=128, warp_m_tiles=2, double_buffer=True, interleave_pv=True),
         _F(32, block_m=256, block_n=128, warp_m_tiles=2), _F(32, warp_m_tiles=2),
         _F(32, block_m=256, warp_m_tiles=2)],
    96: [_F(96), _F(96, block_m=64), _F(96, block_n=128), _F(96, block_m=64, block_n=128),
         _F(96, block_m=64, block_n=128, double_buffer=True), _F(96, block_m=64, block_n=128, early_k=True),
         _F(96, block_m=192), _F(96, warp_m_tiles=2, q_in_regs=False),
         _F(96, warp_m_tiles=2, q_in_regs=False, double_buffer=True),
         _F(96, warp_m_tiles=2, q_in_regs=False, early_k=True),
         _F(96, warp_m_tiles=2, q_in_regs=False, double_buffer=True, early_k=True),
         _F(96, warp_m_tiles=2, q_in_regs=False, double_buffer=True, interleave_pv=True),
         _F(96, block_n=32, warp_m_tiles=2, q_in_regs=False)],
    # 128 x 64 needs 128 KB of shared memory: sm_80, sm_90 and sm_100 only (forward_config
    # passes it over elsewhere); 64 x 64 and 128 x 32 need 96 KB.
    256: [_F(256, block_n=32), _F(256, block_m=64, block_n=32), _F(256), _F(256, double_buffer=True),
          _F(256, early_k=True), _F(256, double_buffer=True, early_k=True), _F(256, block_m=64),
          _F(256, block_m=64, double_buffer=True), _F(256, block_m=64, early_k=True)],
}
_W = WsConfig
_WS_CANDIDATES = {
    64: [_W(64, block_n=192, pingpong=True), _W(64, block_n=192),
         # Three KV stages at 128 x 128 won d64 causal at 1k and 2k on an H100 (292 and 341
         # TFLOP/s against 251 and 331 for 128 x 192) and shipped as the causal short entry
         # until the three-consumer tiles overtook them.
         _W(64, stages=3, pingpong=True), _W(64, stages=3),
         # Three consumer warpgroups (192 query rows, 160 registers each; block_n <= 128),
         # FlashAttention-3's d64 tile height: one more warpgroup to hide the softmax behind GEMMs.
         _W(64, consumers=3, pingpong=True), _W(64, consumers=3),
         # with a third stage: a tie at d64 4k causal (medians 1.7% apart, inside the spread)
         _W(64, stages=3, consumers=3, pingpong=True)],
    96: [_W(96), _W(96, pingpong=True),
         _W(96, block_n=192, pingpong=True), _W(96, block_n=192)],
    128: [_W(128), _W(128, pingpong=True), _W(128, q_stages=1),
          # FlashAttention-3's non-causal d128 tile, 128 x 176: two 44 KB stages of K and of V
          # leave no room for a second Q buffer or an O tile; O is staged in the V ring, as
          # FlashAttention-3 does, so that the one Q buffer is free before the last PV
          _W(128, block_n=176, q_stages=1, o_in_v=True),
          _W(128, block_n=176, pingpong=True, q_stages=1, o_in_v=True),
          # One Q buffer and O in the V ring leave room for three KV stages at 128 x 128: ties
          # the shipped tile at 16k (640 against 635-641 TFLOP/s, bf16, H100), 3-8% behind at 4k.
          _W(128, stages=3, q_stages=1, o_in_v=True)],
    # 128 x 256 O accumulators leave room for S tiles of 80 or 64 keys; no O tile fits beside them
    # (O is staged in the Q buffer). 128 x 80 spills with causal masking (14-20 LDL/STL); 128 x 64
    # does not.
    256: [_W(256, block_n=80, q_stages=1, o_in_q=True),
          _W(256, block_n=80, pingpong=True, q_stages=1, o_in_q=True),
          _W(256, block_n=64, q_stages=1, o_in_q=True),
          _W(256, block_n=64, pingpong=True, q_stages=1, o_in_q=True)],
}
# On Hopper both families run at the Hopper kernel's head dims: its candidates, then the sm80 family's.
CANDIDATES: dict[tuple[str, int], list[KernelConfig]] = {
    **{("sm80", d): configs for d, configs in _SM80_CANDIDATES.items()},
    **{("sm90", d): _WS_CANDIDATES[d] + _SM80_CANDIDATES[d] for d in FAMILY_HEAD_DIMS["sm90"]},
}
# Set by benchmarks/autotune.py and tests to launch a given candidate: table key -> config.
OVERRIDES: dict[str, KernelConfig | BackwardConfig | WsBackwardConfig] = {}


def arch_family(capability: tuple[int, int]) -> str:
    """'sm90' for Hopper, 'sm80' for every other supported GPU (sm_80 .. sm_89, sm_100+)."""
    return "sm90" if tuple(capability)[0] == 9 else "sm80"


def dispatch_family(capability: tuple[int, int], head_dim: int, varlen: bool = False) -> str:
    """The family whose kernel runs ``head_dim`` on this GPU: its own, or 'sm80' (the mma.sync
    kernel runs everywhere) where its own kernel lacks the head dim (Hopper at 32) or the call's
    kind of kernel (``varlen``: packed variable-length; ``Family.runs``)."""
    family = arch_family(capability)
    own = head_dim in FAMILY_HEAD_DIMS[family] and FAMILIES[family].runs("forward", varlen)
    return family if own else "sm80"


# A problem whose seqlen_q and seqlen_k are both at most SHORT_SEQLEN first looks for a
# "short" table entry (``<key>/short``): at short sequences tile padding and the causal
# diagonal weigh more, so other configs can win (the mma.sync d128 causal entry; d64 lost both of
# its short entries: the causal one once the 192-row tiles had caught up at 1k and pulled ahead at
# 2k, the non-causal one, three ping-pong consumer warpgroups, once that tile won at 4k and 8k
# too, docs/PERFORMANCE.md [PP64]).
SHORT_SEQLEN = 2048
# A problem whose longer sequence is at least LONG_SEQLEN first looks for a "long" entry
# (``<key>/long``): there a KV tile that does not divide the length costs little (d128 128 x 176,
# FlashAttention-3's tile: 1% padding at 8k and 16k keys, 3% at 4k; d96 128 x 192 with ping-pong,
# +2.7-2.9% over 128 x 128 at 16k on an H200).
LONG_SEQLEN = 8192


def table_key(family: str, head_dim: int, causal: bool, short: bool = False, long: bool = False) -> str:
    span = "/short" if short else "/long" if long else ""
    return f"{family}/d{head_dim}/{'causal' if causal else 'full'}{span}"


def config_to_json(config: KernelConfig) -> dict:
    import dataclasses

    return {"kernel": family_of(config).table_kind, **dataclasses.asdict(config)}


def config_from_json(entry: dict) -> KernelConfig:
    fields = {k: v for k, v in entry.items() if k not in ("kernel", "tflops")}
    return family_of_table_kind(entry.get("kernel", "mma")).config_type(**fields)


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    if TABLE_PATH.is_file():
        return json.loads(TABLE_PATH.read_text())
    return {}


def max_shared_bytes(capability: tuple[int, int]) -> int:
    """Dynamic shared memory a CTA may opt in to on a GPU of this capability: the known value,
    else the smallest of any sm_80+ GPU (``SMALLEST_SHARED_BYTES``)."""
    return MAX_SHARED_BYTES.get(tuple(capability), SMALLEST_SHARED_BYTES)


def forward_config(capability: tuple[int, int], head_dim: int, causal: bool,
                   shared_limit: int | None = None, seqlen: int | None = None, *,
                   window: bool = False, varlen: bool = False, head_dim_v: int = 0) -> KernelConfig:
    """The configuration to launch for this GPU and problem: a forced one (``force_config``),
    else the tuned table's or the default of ``dispatch_family``. In the sm80 family a GPU's
    own entry (e.g. ``sm86/d128/full``, from an autotune run on that GPU) comes before the
    family's (``sm80/...``, tuned on the GPUs we had).

    A table entry that needs more shared memory than the GPU gives a CTA (``shared_limit``, the
    device's opt-in maximum; by default ``max_shared_bytes(capability)``) is passed over, and
    the next key or the default is taken: ``sm80/d256/*`` may ship 128 KB tiles (sm_80, sm_90,
    sm_100) while sm_86, sm_89 and sm_120 (99 KB) run ``DEFAULTS``, which fit every GPU. A
    forced config is returned as it is (the launch then fails with a message if it does not fit).

    ``seqlen``: the problem's longest sequence (max of seqlen_q and seqlen_k); at most
    ``SHORT_SEQLEN``, each key's ``/short`` entry comes before it, and at least ``LONG_SEQLEN``,
    its ``/long`` entry. None: the plain entry.

    ``window``, ``varlen``: the call's variant (a sliding window, packed sequences): its table
    entries come first (``VARIANT_KEYS``); where the GPU's own family lacks the kernel
    (``dispatch_family``), the sm80 family's config (a forced config of a family that lacks it is
    passed over).

    ``head_dim_v``: V's head dim where it differs (``ASYMMETRIC_HEAD_DIMS``): a forced config of
    the pair, else on Hopper its ``ASYMMETRIC_WS_DEFAULTS`` config where it fits, else its
    ``ASYMMETRIC_DEFAULTS`` config (the mma.sync family's, every GPU; ``ASYMMETRIC_FALLBACKS``
    where that does not fit), dense or packed (no table entries yet).
    """
    if head_dim_v and head_dim_v != head_dim:
        pair = (head_dim, head_dim_v)
        config = ASYMMETRIC_DEFAULTS.get(pair)
        if config is None:
            raise ValueError(f"no forward kernel for head_dim {head_dim} with head_dim_v {head_dim_v}")
        forced = OVERRIDES.get(table_key(arch_family(capability), head_dim, causal)) if OVERRIDES else None
        if (forced is not None and forced.value_dim == head_dim_v
                and family_of(forced).runs("forward", varlen)):
            return forced
        hopper = ASYMMETRIC_WS_DEFAULTS.get(pair)
        limit = max_shared_bytes(capability) if shared_limit is None else shared_limit
        if (hopper is not None and arch_family(capability) == "sm90" and hopper.shared_bytes <= limit
                and family_of(hopper).runs("forward", varlen)):
            return hopper
        if config.shared_bytes > limit:  # the first fallback that fits (else the launch says it does not)
            return next((c for c in ASYMMETRIC_FALLBACKS.get(pair, ()) if c.shared_bytes <= limit), config)
        return config
    if OVERRIDES:
        forced = OVERRIDES.get(table_key(arch_family(capability), head_dim, causal))
        if forced is not None and family_of(forced).runs("forward", varlen):
            return forced
    limit = max_shared_bytes(capability) if shared_limit is None else shared_limit
    span = seqlen_span(seqlen)
    return _table_choice(tuple(capability), head_dim, causal, limit, "/" + span if span else "", window,
                         varlen)


# A call with a sliding window or packed sequences first looks
# for a ``<key>/window`` or ``<key>/varlen`` entry (each span's, then the plain one's): where a
# variant's extra registers spill the plain call's config (d256 128 x 80 on Hopper), it runs
# another.
VARIANT_KEYS = ("varlen", "window")  # in the order their entries are looked up


def seqlen_span(seqlen: int | None) -> str:
    """Which table entries a problem whose longer sequence is ``seqlen`` reads first: "short"
    (at most ``SHORT_SEQLEN``), "long" (at least ``LONG_SEQLEN``) or "" (None: the plain entry)."""
    if seqlen is None:
        return ""
    return "short" if seqlen <= SHORT_SEQLEN else "long" if seqlen >= LONG_SEQLEN else ""


@functools.lru_cache(maxsize=1024)
def _table_choice(capability: tuple[int, int], head_dim: int, causal: bool, limit: int,
                  span: str, window: bool = False, varlen: bool = False) -> KernelConfig:
    """``forward_config`` without a forced config (the table is read once per process)."""
    family = dispatch_family(capability, head_dim, varlen)
    keys = [table_key(family, head_dim, causal)]
    if family == "sm80":
        keys.insert(0, table_key(f"sm{capability[0]}{capability[1]}", head_dim, causal))
    if span:
        keys = [k for key in keys for k in (key + span, key)]
    variants = [f"/{v}" for v, on in zip(VARIANT_KEYS, (varlen, window), strict=True) if on]
    keys = [key + v for key in keys for v in variants] + keys
    for key in keys:
        if key in _table():
            config = config_from_json(_table()[key])
            # (on Hopper the GPU's own key, sm90/..., may hold another family's config)
            if config.shared_bytes <= limit and family_of(config).runs("forward", varlen):
                return config
    config = DEFAULTS[(family, head_dim)]
    if config.shared_bytes > limit:
        raise RuntimeError(f"no {family} config for head_dim {head_dim} fits in {limit} bytes of shared "
                           f"memory a CTA (the default {config} needs {config.shared_bytes})")
    return config


FAMILY_CAPABILITY = {"sm80": (8, 0), "sm90": (9, 0)}  # a representative GPU of each family
# Representative GPUs of the sm80 family with less shared memory a CTA than sm_80 (99 KB: sm_86,
# sm_89, sm_120): where the table's config does not fit them they run another one.
SMALL_SHARED_CAPABILITIES = ((8, 6),)


def shipped_configs(window: bool = False, varlen: bool = False,
                    long: bool = True) -> list[tuple[str, int, bool, KernelConfig]]:
    """Every (family, head dim, causal, config) the dispatcher can launch for the variant (each
    family at its own head dims: the others run the sm80 family's config), including the sm80
    family's configs for GPUs of 99 KB of shared memory a CTA where they differ, and each family's
    short- and, with ``long``, long-sequence configs (``SHORT_SEQLEN``, ``LONG_SEQLEN``) where they
    differ."""
    # (family, GPU capability, seqlen) of each dispatch that may pick its own configs
    points = [(family, cap, None) for family, cap in FAMILY_CAPABILITY.items()]
    points += [(family, cap, span) for span in (SHORT_SEQLEN, LONG_SEQLEN) if long or span != LONG_SEQLEN
               for family, cap in FAMILY_CAPABILITY.items()]
    points += [("sm80", cap, None) for cap in SMALL_SHARED_CAPABILITIES]
    shipped = []
    for family, cap, seqlen in points:
        for d in FAMILY_HEAD_DIMS[family]:
            for causal in (False, True):
                item = (family, d, causal, forward_config(cap, d, causal, seqlen=seqlen, window=window,
                                                          varlen=varlen))
                if item not in shipped:
                    shipped.append(item)
    return shipped


def runnable_families(capability: tuple[int, int]) -> list[str]:
    """Kernel families that run on a GPU of this capability: Hopper runs both (the mma.sync
    kernel is what every other GPU gets, so it is tested on Hopper too)."""
    return ["sm90", "sm80"] if arch_family(capability) == "sm90" else ["sm80"]


def runnable_candidates(capability: tuple[int, int], head_dim: int) -> list[KernelConfig]:
    """Every candidate config that may run on a GPU of this capability for ``head_dim`` (both
    families on Hopper at the head dims of its own kernel, else the sm80 family's)."""
    return list(CANDIDATES[(dispatch_family(capability, head_dim), head_dim)])


@contextlib.contextmanager
def force_config(capability: tuple[int, int], causal: bool,
                 config: KernelConfig | BackwardConfig | WsBackwardConfig) -> Iterator[None]:
    """Within the block, ``flash_attention`` on this GPU launches ``config`` for its head dim
    and ``causal`` (any family that runs here); for a ``BackwardConfig``,
    ``flash_attention_backward`` does (every GPU runs it), and for a ``WsBackwardConfig`` too
    (Hopper only; not for packed variable-length calls, which run the mma.sync backward). Not
    thread-safe: for tests and tools."""
    family = family_of(config)
    if family is SM80_BWD:
        key = backward_table_key(config.head_dim, causal)
    elif family is SM90_BWD:
        if not backward_runnable(config, capability):
            raise ValueError(f"{config} needs {family.gpus}; this GPU is sm_{capability[0]}{capability[1]}")
        key = backward_table_key(config.head_dim, causal, family.name)
    elif family.name not in runnable_families(capability):
        raise ValueError(f"{config} needs {family.gpus}; this GPU is sm_{capability[0]}{capability[1]}")
    else:
        key = table_key(arch_family(capability), config.head_dim, causal)
    previous = OVERRIDES.get(key)
    OVERRIDES[key] = config
    try:
        yield
    finally:
        if previous is None:
            OVERRIDES.pop(key, None)
        else:
            OVERRIDES[key] = previous


# ---------------------------------------------------------------------------- backward

# The mma.sync backward (``operations.backward``): one family, run by every GPU from sm_80 on
# (Hopper too, at the head dims and for the calls its own backward lacks: ``backward_dispatch_family``).
# Its tuned entries sit in the same table under their own keys (``backward_table_key``:
# ``sm80bwd/d128/causal``, ``"kernel": "mma_bwd"``), written by autotune; entries missing from it
# use ``BACKWARD_DEFAULTS``. The warp-specialised Hopper backward (``WsBackwardConfig``, family
# sm90bwd) runs head dims 64 and 128 on Hopper: entries ``sm90bwd/d128/causal`` (``"kernel":
# "ws_bwd"``), else ``BACKWARD_WS_DEFAULTS``.
BACKWARD_FAMILY = SM80_BWD.name
_B = BackwardConfig
# Per head dim, in order of preference: the first that fits the GPU's shared memory a CTA runs.
# FlashAttention-2's backward tiles: 64 query rows a step, 128 keys a CTA over 8 warps, the next
# query block's Q and dO loaded during this one (q_stages 2); one Q stage, then 64 keys, where
# that needs too much shared memory. The last, 64 keys and one Q stage (80.5 KB at d128), is what
# d128 runs on GPUs of 99 KB a CTA (sm_86, sm_89, sm_120: the others need 113 KB or more); d256
# has no tile that fits there (FlashAttention-2 needs an A100 or H100 for it too).
# At head dims 64 and 128 the first is the same tile with two m-tiles a warp in every product
# (key_tiles=2, dq_tiles=2): H100, 4k, fp16, +11-13% at d128 and +5-9% at d64 against one m-tile
# a warp (docs/PERFORMANCE.md, "Measurements behind dispatch rules").
BACKWARD_DEFAULTS: dict[int, list[BackwardConfig]] = {
    **{d: ([_B(d, block_m=64, block_n=128, key_tiles=2, dq_tiles=2)] if d in (64, 128) else [])
       + [_B(d, block_m=64, block_n=128), _B(d, block_m=64, block_n=128, q_stages=1),
          _B(d, block_m=64, block_n=64), _B(d, block_m=64, block_n=64, q_stages=1)]
       for d in (32, 64, 96, 128)},
    256: [_B(256, block_m=64, block_n=64), _B(256, block_m=64, block_n=64, q_stages=1)],
}


def _two_tiles(config: BackwardConfig) -> list[BackwardConfig]:
    """``config`` with two m-tiles a warp in both kinds of product, where that is a valid config."""
    config = dataclasses.replace(config, key_tiles=2, dq_tiles=2)
    try:
        config.check()
    except ValueError:
        return []
    return [config]


# What autotune, the sanitizer and precompile --candidates try, by head dim: the defaults, and
# each with two 16-row m-tiles a warp in Sᵀ/dPᵀ/dK/dV and in dQ (key_tiles=2, dq_tiles=2: on an
# H100 at 4k, d128, 0.60 -> 0.68-0.69 of SDPA flash's backward) where the warps still split
# evenly (not at head dims 32 and 96).
# At head dim 64 also FlashAttention-2's d64 tile: 128 query rows a step (its kBlockM 128 with
# 2 x 4 warps over S and dP, 4 x 2 over dK/dV and dQ, which key_tiles=2 and dq_tiles=2 give).
BACKWARD_CANDIDATES: dict[int, list[BackwardConfig]] = {
    d: list(dict.fromkeys(defaults + [t for c in defaults for t in _two_tiles(c)]
                          + ([_B(64, block_m=128, block_n=128, key_tiles=2, dq_tiles=2)] if d == 64 else [])))
    for d, defaults in BACKWARD_DEFAULTS.items()
}


# The Hopper backward (``WsBackwardConfig``), per head dim in order of preference: two consumer
# warpgroups of 64 keys (128 keys a CTA) and a ring of two query blocks; at d64 128 query rows a
# step (the warpgroups split dQ by rows) with P's exponentials beside dPᵀ's GEMM (``early_p``),
# at d128 64 (they split dQ's head-dim columns) with the next step's rows staged once the step's
# first GEMMs are issued (``late_rows``). Head dims without an entry run the mma.sync backward on
# Hopper (``backward_dispatch_family``).
_WB = WsBackwardConfig
BACKWARD_WS_DEFAULTS: dict[int, list[WsBackwardConfig]] = {
    64: [_WB(64, block_m=128, early_p=True)],
    128: [_WB(128, block_m=64, late_rows=True)],
}
# Where calls of long query sequences (at least BACKWARD_LONG_SEQLEN rows; no window, no softcap)
# take another Hopper tile ahead of the defaults: at d128 FA4's non-causal one, 80 query rows a step,
# the warpgroups computing dQᵀ = Kᵀ dSᵀ (wgmma's M is 64: 80 rows cannot be dQ's M). H200, bf16,
# against 64 rows (docs/PERFORMANCE.md [B80]): 1k -3%, 2k -1%, 4k and 8k tied, 16k +1 to +2%
# (causal +1.4%), 32k +2%: the last query block's padding (up to 79 rows) weighs less there.
BACKWARD_LONG_SEQLEN = 16384
BACKWARD_WS_LONG: dict[int, list[WsBackwardConfig]] = {128: [_WB(128, block_m=80, late_rows=True)]}
_BACKWARD_DEFAULTS_OF = {SM80_BWD.name: BACKWARD_DEFAULTS, SM90_BWD.name: BACKWARD_WS_DEFAULTS}


def backward_table_key(head_dim: int, causal: bool, family: str = BACKWARD_FAMILY) -> str:
    """The tuned table's (and ``OVERRIDES``') key of the backward config for ``head_dim`` and
    ``causal``: ``sm80bwd/d128/causal`` (``family``: ``sm90bwd`` for the Hopper backward's)."""
    return table_key(family, head_dim, causal)


# (head dim, window, softcap) the Hopper backward leaves to the mma.sync one: these builds
# spill (LDL/STL in the offline SASS, sm_90a): d64 softcap (12 in the non-causal build: 128 query
# columns of Sᵀ, dPᵀ and their tanh beside dK and dV) and window + softcap at d64 and d128 (7).
# ``tests/test_backward_ws_offline.py`` checks every other build.
WS_BACKWARD_LEFT_TO_MMA = frozenset({(64, False, True), (64, True, True), (128, True, True)})


def backward_dispatch_family(capability: tuple[int, int], head_dim: int, window: bool = False,
                             softcap: bool = False, varlen: bool = False) -> str:
    """The backward family that runs ``head_dim`` on this GPU (``families.SM80_BWD.name`` or
    ``SM90_BWD.name``), as ``dispatch_family`` for the forward: Hopper runs its own backward at the
    head dims it has (``BACKWARD_WS_DEFAULTS``) for the variants it has (``window``, ``softcap``:
    but those of ``WS_BACKWARD_LEFT_TO_MMA``; not the packed variable-length ones, ``varlen``),
    every other call and GPU the mma.sync backward."""
    if (arch_family(capability) == "sm90" and head_dim in BACKWARD_WS_DEFAULTS
            and SM90_BWD.runs("backward", varlen)
            and (head_dim, bool(window), bool(softcap)) not in WS_BACKWARD_LEFT_TO_MMA):
        return SM90_BWD.name
    return SM80_BWD.name


def backward_runnable(config: BackwardConfig | WsBackwardConfig, capability: tuple[int, int]) -> bool:
    """Whether a GPU of ``capability`` runs ``config``'s kernels: the mma.sync backward's run on
    every GPU, the Hopper backward's on sm_90 only."""
    return family_of(config) is not SM90_BWD or arch_family(capability) == "sm90"


def backward_config(capability: tuple[int, int], head_dim: int, causal: bool,
                    shared_limit: int | None = None, *, window: bool = False, softcap: bool = False,
                    varlen: bool = False, head_dim_v: int = 0, long: bool = False
                    ) -> BackwardConfig | WsBackwardConfig:
    """The backward configuration to launch on this GPU for a call of the variant ``window``,
    ``softcap``, ``varlen``: in the family of ``backward_dispatch_family``, a forced one
    (``force_config``), else the tuned table's entry (``backward_table_key``), else the first of
    the family's defaults (``BACKWARD_DEFAULTS[head_dim]``, ``BACKWARD_WS_DEFAULTS[head_dim]``),
    each passed over where it needs more shared memory than the GPU gives a CTA (``shared_limit``,
    by default ``max_shared_bytes(capability)``; where no Hopper config fits, the mma.sync
    backward's choice). A forced ``BackwardConfig`` runs on any GPU (also where the Hopper backward
    would), a forced ``WsBackwardConfig`` where its family runs this call. A forced config is
    returned as it is (the launch then fails with a message if it does not fit), apart from what
    the target sets on a ``BackwardConfig`` (``backward_for_target``).

    Raises:
        ValueError: a head dim with no backward configs.
        RuntimeError: no config of this head dim fits in ``shared_limit``.

    ``head_dim_v``: V's head dim where it differs (``ASYMMETRIC_HEAD_DIMS``): on Hopper, for a dense
    call, the pair's ``ASYMMETRIC_BACKWARD_WS`` config where it has one and it fits; else the pair's
    ``ASYMMETRIC_BACKWARD_DEFAULTS`` config (every GPU, dense or packed). A forced config of the
    pair's head dims (either family) is returned as it is.

    ``long``: the call has at least ``BACKWARD_LONG_SEQLEN`` query rows (``backward_is_long``):
    without a window or softcap, on Hopper, ``BACKWARD_WS_LONG``'s config comes first.
    """
    if head_dim_v and head_dim_v != head_dim:
        choices = ASYMMETRIC_BACKWARD_DEFAULTS.get((head_dim, head_dim_v))
        if choices is None:
            raise ValueError(f"no backward kernel for head_dim {head_dim} with head_dim_v {head_dim_v}")
        pair = (head_dim, head_dim_v)
        keys = [backward_table_key(head_dim, causal)]
        if not varlen:  # the Hopper backward has no packed kernels
            keys.insert(0, backward_table_key(head_dim, causal, SM90_BWD.name))
        for key in keys:
            forced = OVERRIDES.get(key) if OVERRIDES else None
            if forced is not None and forced.value_dim == head_dim_v:  # force_config's
                return backward_for_target(forced, capability)
        limit = max_shared_bytes(capability) if shared_limit is None else shared_limit
        hopper = ASYMMETRIC_BACKWARD_WS.get(pair)
        if (hopper is not None and arch_family(capability) == "sm90" and not varlen
                and hopper.shared_bytes <= limit):
            return hopper
        for config in choices:
            if config.shared_bytes <= limit:
                return backward_for_target(config, capability)
        raise RuntimeError(f"no backward config of head_dim {head_dim} with head_dim_v {head_dim_v} fits "
                           f"{limit} bytes of shared memory a CTA")
    family = backward_dispatch_family(capability, head_dim, window, softcap, varlen)
    if OVERRIDES:
        if family != BACKWARD_FAMILY:
            forced = OVERRIDES.get(backward_table_key(head_dim, causal, family))
            if forced is not None:
                return forced
        forced = OVERRIDES.get(backward_table_key(head_dim, causal))
        if forced is not None:
            return backward_for_target(forced, capability)
    limit = max_shared_bytes(capability) if shared_limit is None else shared_limit
    if family != BACKWARD_FAMILY:
        try:
            return _backward_choice(head_dim, causal, limit, family, long and not (window or softcap))
        except RuntimeError:  # no Hopper tile fits a lowered limit: the mma.sync backward's
            pass
    return backward_for_target(_backward_choice(head_dim, causal, limit), capability)


def backward_for_target(config: BackwardConfig, capability: tuple[int, int]) -> BackwardConfig:
    """``config`` as a GPU of ``capability`` compiles it: the dQ accumulator added four floats
    at a time (``dq_vector`` 4, ``red.global.add.v4.f32``) from sm_90 on, one at a time before.
    H100, bf16, main kernel: -1.3 to -1.9% at d64 and d128, 4k and 16k (docs/PERFORMANCE.md,
    "Backward speed, mma.sync backward"). Any other family's config (the Hopper
    backward's, which always adds four) is returned as it is."""
    if family_of(config) is not SM80_BWD:
        return config
    return dataclasses.replace(config, dq_vector=4 if tuple(capability)[0] >= 9 else 1)


@functools.lru_cache(maxsize=256)
def _backward_choice(head_dim: int, causal: bool, limit: int, family: str = BACKWARD_FAMILY,
                     long: bool = False) -> BackwardConfig | WsBackwardConfig:
    """``backward_config`` of ``family`` without a forced config (the table is read once per
    process); ``long``: a call of at least ``BACKWARD_LONG_SEQLEN`` query rows with no window and
    no softcap, which on Hopper tries ``BACKWARD_WS_LONG`` before the defaults."""
    defaults = _BACKWARD_DEFAULTS_OF[family]
    if head_dim not in defaults:
        raise ValueError(f"head_dim must be one of {tuple(defaults)} for the backward, got {head_dim}")
    key = backward_table_key(head_dim, causal, family)
    tried: list = []
    if key in _table():
        config = config_from_json(_table()[key])
        if family_of(config) is not FAMILIES[family] or config.head_dim != head_dim:
            raise ValueError(f"the tuned table's entry {key} must be a {FAMILIES[family].table_kind} "
                             f"config of head_dim {head_dim}, got {config}")
        tried.append(config)
    if long and family == SM90_BWD.name:
        tried += BACKWARD_WS_LONG.get(head_dim, [])
    tried += defaults[head_dim]
    for config in tried:
        if config.shared_bytes <= limit:
            return config
    needs = ", ".join(f"{c} needs {c.shared_bytes}" for c in tried)
    raise RuntimeError(f"no backward config for head_dim {head_dim} fits in {limit} bytes of shared memory "
                       f"a CTA ({needs})")


def backward_is_long(seqlen_q: int, varlen: bool = False) -> bool:
    """Whether a dense backward call of ``seqlen_q`` query rows takes the long-sequence configs
    (``BACKWARD_WS_LONG``): packed (``varlen``) calls never do."""
    return not varlen and seqlen_q >= BACKWARD_LONG_SEQLEN


def shipped_backward_configs(window: bool = False, softcap: bool = False, varlen: bool = False,
                             long: bool = True) -> list[tuple[int, bool, BackwardConfig | WsBackwardConfig]]:
    """Every (head dim, causal, config) the backward can launch unforced for a call of the variant
    ``window``, ``softcap``, ``varlen`` on the representative GPUs (``FAMILY_CAPABILITY`` and
    ``SMALL_SHARED_CAPABILITIES``): the mma.sync backward's and, on Hopper, the Hopper backward's
    (``backward_dispatch_family``; ``varlen`` gives the mma.sync configs Hopper runs packed calls
    with), short query sequences and, with ``long``, long ones (``backward_is_long``); each once; a GPU
    where no config of a head dim fits adds nothing for it."""
    shipped = []
    for cap in (*FAMILY_CAPABILITY.values(), *SMALL_SHARED_CAPABILITIES):
        for d in BACKWARD_DEFAULTS:
            for causal, is_long in itertools.product((False, True), (False, True) if long and not varlen
                                                     else (False,)):
                try:
                    item = (d, causal, backward_config(cap, d, causal, window=window, softcap=softcap,
                                                       varlen=varlen, long=is_long))
                except RuntimeError:
                    continue
                if item not in shipped:
                    shipped.append(item)
    return shipped


FAMILY_ARCH = {name: family.arch for name, family in FAMILIES.items()}  # the target each family compiles for


def kernel_sources(spec: KernelSpec) -> str:
    """The digest of the files ``spec``'s kernel is built from (``kernels.families.
    kernel_source_files``): an edit changes the keys of the kernels it can change, no others."""
    from .kernels.families import kernel_source_files
    from .runtime.cache import source_digest

    return source_digest(kernel_source_files(spec.family, spec.operation))


def kernel_key(spec: KernelSpec) -> str:
    """The on-disk cache key of ``spec``'s kernel (``runtime.cache.kernel_key`` over its own
    sources): what ``kernel_cubin`` stores it under."""
    from .runtime.cache import kernel_key as key_of

    return key_of(spec, sources=kernel_sources(spec))


def kernel_cubin(spec: KernelSpec):
    """The linked cubin (``runtime.cache.CacheEntry``) of ``spec``'s kernel for ``spec.arch``: from
    the on-disk cache, or compiled and stored. The API and ``precompile`` both come here, so they
    agree on the cache key (the spec, normalised when built: ``kernels.spec.kernel_spec``, and
    its sources: ``kernel_key``)."""
    from .kernels.families import kernel_argtypes, make_kernel
    from .runtime.cache import cached_cubin

    def build():  # imports Numba: only on a cache miss
        return make_kernel(spec), kernel_argtypes(spec)

    return cached_cubin(spec, build, sources=kernel_sources(spec))


DECODE_FORCED: list = []  # [a DecodeConfig] that decode_config returns for its head dim (force_decode_config)


@contextlib.contextmanager
def force_decode_config(config):
    """Inside the block, decode calls of ``config.head_dim`` launch ``config`` (the sanitizer's and
    the tests' way to run a config this GPU would not pick; its rows and paging must fit the call)."""
    DECODE_FORCED.append(config)
    try:
        yield
    finally:
        DECODE_FORCED.remove(config)


def decode_config(capability: tuple[int, int], head_dim: int, rows: int, paged: bool,
                  shared_limit: int | None = None, wide: bool = False, head_dim_v: int = 0,
                  page_size: int = 0):
    """The decode kernel's config: 16 packed query rows a CTA, or 32 where the query heads of a
    KV head times seqlen_q need more and the head dim is at most 128 (at d256 a thread's O for
    32 rows is 256 floats: 600 spill instructions, half the speed of two 16-row blocks that read
    K and V twice, on an H100); 64 keys over 4 warps and a ring of 3, else smaller,
    whichever first fits the GPU's shared memory a CTA; at head dim 64 with 16 rows, 128 keys
    over 4 warps and a ring of 2 first (1.2% faster at 128 x 2048 keys on an H100; paged, H200:
    0.93-0.97 of the contiguous cache at pages of 16-256, 0.82-0.85 with 64 keys and a ring of 3).

    ``wide``: the call's (batch, KV head, row block) CTAs outnumber the SMs. At head dim 128 and
    16 rows a ring of 3 streams best at one CTA a SM (``launch_decode.streaming_ctas``), which
    such a grid fills in two waves or more; a ring of 2 runs two a SM, in half the waves (H100:
    32 x 4096 keys 0.986-0.990 of cuDNN with the ring of 3, 1.007-1.012 with the ring of
    2; 64 x 32768 level). A paged cache takes the ring of 2 whatever the grid: its walk issues
    more per tile (the rows' addresses from shared memory), which one CTA's 4 warps cannot hide
    (H200, pages of 64: 0.82-0.88 of the contiguous cache at one CTA a SM, 0.93-1.00 at two).
    With 16 rows and a contiguous cache, head dim 32 takes 256-key tiles
    (its 64-byte rows: 64 keys a tile made 4 KB requests; 8 x 8192 keys 0.88-0.90 of the best SDPA
    backend -> 0.95-0.96, 64 x 4096 1.01-1.02 -> 1.14) and head dim 96 a ring of 2 (8 x 8192 0.95
    -> 0.96-0.98, 64 x 4096 and 1 x 65536 +2-5%); paged too (paged / contiguous at
    d32 0.91-0.94 -> 0.94-1.01, at d96 0.93-0.95 -> 0.97-0.99). Every figure here:
    docs/PERFORMANCE.md, "Measurements behind dispatch rules".

    ``head_dim_v``: V's head dim where it differs (``ASYMMETRIC_HEAD_DIMS``): the general shapes
    below with V's tiles and O that wide (not tuned yet).

    ``page_size``: a paged cache's page size where each sequence's keys start at row 0 of its first
    page (no cache_leftpad; 0: unknown or not so). Where the paged config's tiles divide it, it
    runs with ``page_tiles`` (a tile's page looked up once, its rows copied as contiguous ones):
    H200, pages of 64, paged / contiguous 0.959-0.983 against 0.936-0.970 by rows, and 0.896-0.943
    on the contiguous config (a ring of 3 at one CTA a SM, where the look-ups show;
    docs/PERFORMANCE.md [PT])."""
    from .kernels.shapes import DecodeConfig

    value_dim = head_dim_v or head_dim
    if DECODE_FORCED and (DECODE_FORCED[0].head_dim, DECODE_FORCED[0].value_dim) == (head_dim, value_dim):
        return DECODE_FORCED[0]
    if paged and page_size > 0:
        by_rows = decode_config(capability, head_dim, rows, True, shared_limit, wide, head_dim_v)
        if page_size % by_rows.block_n == 0:
            return dataclasses.replace(by_rows, page_tiles=True)
    limit = max_shared_bytes(capability) if shared_limit is None else shared_limit
    m_tiles = 1 if rows <= 16 or head_dim > 128 else 2
    shapes = ((64, 4), (32, 2))  # (keys a tile, warps), each with a ring of 3, then 2
    if value_dim != head_dim:
        if (head_dim, value_dim) not in DECODE_HEAD_DIM_PAIRS:
            raise ValueError(f"no decode kernel for head_dim {head_dim} with head_dim_v {value_dim}")
        tried = [DecodeConfig(head_dim, block_n=n, num_warps=w, m_tiles=m_tiles, stages=s, paged=paged,
                              head_dim_v=value_dim) for n, w in shapes for s in (3, 2)]
    else:
        tried = []
        if head_dim == 64 and m_tiles == 1:  # 128 keys, ring of 2: +1.2% (H100)
            tried.append(DecodeConfig(64, block_n=128, num_warps=4, stages=2, paged=paged))
        if head_dim == 128 and m_tiles == 1 and (wide or paged):  # two CTAs a SM (H100, H200)
            tried.append(DecodeConfig(128, block_n=64, num_warps=4, stages=2, paged=paged))
        if head_dim == 32 and m_tiles == 1:  # 256 keys: +7-12%, paged +4-8% (H100)
            tried.append(DecodeConfig(32, block_n=256, num_warps=4, stages=3, paged=paged))
        if head_dim == 96 and m_tiles == 1:  # a ring of 2: +2-5%, paged +2-5% (H100)
            tried.append(DecodeConfig(96, block_n=64, num_warps=4, stages=2, paged=paged))
        tried += [DecodeConfig(head_dim, block_n=n, num_warps=w, m_tiles=m_tiles, stages=s, paged=paged)
                  for n, w in shapes for s in (3, 2)]
    for config in tried:
        if config.shared_bytes <= limit:
            return config
    raise RuntimeError(f"no decode config for head_dim {head_dim} fits in {limit} bytes of shared memory "
                       "a CTA")


# MLA decode's (head_dim, head_dim_v): DeepSeek's latent cache row (512 latent + 64 rotary), V its
# first 512 values (``api.flash_mla_with_kvcache``).
MLA_HEAD_DIMS = (576, 512)


def mla_decode_config(capability: tuple[int, int], rows: int, paged: bool, shared_limit: int | None = None):
    """The MLA decode kernel's config for ``rows`` packed query rows (query heads times seqlen_q).

    Hopper (sm_90) above 16 rows: the wgmma kernel (``kernels.mla_ws``, 64 rows a CTA, 64-key tiles
    in a ring of 2, a stage a warpgroup, taken in pairs; H200, 64 x 4096 tokens, pages of 64: 179 µs
    at 128 heads, 153-154 at 64, 124-125 at 32, against the mma.sync kernel's 313, 208 and 128, and
    the first wgmma schedule's 195, 156 and 123 (each warpgroup half of every tile's keys; 32-key
    tiles in a ring of 4: 269, 193, 158); docs/PERFORMANCE.md [MLAP], [MLAW]). At 16 rows it is
    slower (109 µs against 94: 48 of its 64 rows idle) and the mma.sync kernel
    (``kernels.mla_decode``) stays.

    The mma.sync kernel elsewhere: the fewest 16-row m-tiles (1, 2 or 4) that hold the rows, so that
    the cache is read once per 64 rows; 64-key tiles in a ring of 2 (a K tile is 72 KB), which with
    64 rows fills the 227 KB of a Hopper CTA to the byte (H200, 64 x 4096 tokens, pages of 64: 314 µs
    at 128 heads and 206 at 64, against 403 and 254 with 32-key tiles in a ring of 3;
    docs/PERFORMANCE.md, "MLA decode"); whichever first fits the GPU's shared memory a CTA (163 KB
    GPUs such as the A100: 32-key tiles, the 16-row tile's 168 KB does not fit; 99 KB GPUs: 16 rows,
    32-key tiles, 2 warps). The A100's and 99 KB GPUs' configs are checked on an H200 (forced), not
    timed on their GPUs."""
    from .kernels.shapes import MlaDecodeConfig, WsMlaConfig

    if DECODE_FORCED and isinstance(DECODE_FORCED[0], (MlaDecodeConfig, WsMlaConfig)):
        return dataclasses.replace(DECODE_FORCED[0], paged=paged)
    limit = max_shared_bytes(capability) if shared_limit is None else shared_limit
    hopper = WsMlaConfig(block_n=64, stages=2, paged=paged)
    if capability[0] == 9 and rows > 16 and hopper.shared_bytes <= limit:  # wgmma: sm_90a, not sm_100
        return hopper
    m16 = MlaDecodeConfig(m_tiles=1, block_n=64, num_warps=4, key_warps=4, stages=2, paged=paged)
    m32 = MlaDecodeConfig(m_tiles=2, block_n=64, num_warps=8, key_warps=4, stages=2, paged=paged)
    m64 = MlaDecodeConfig(m_tiles=4, block_n=64, num_warps=8, key_warps=4, stages=2, paged=paged)
    # 163 KB GPUs (A100): 32-key tiles for 32 and 64 rows; 99 KB GPUs: 16 rows, 2 warps
    m32_163 = MlaDecodeConfig(m_tiles=2, block_n=32, num_warps=4, key_warps=2, stages=3, paged=paged)
    m64_163 = MlaDecodeConfig(m_tiles=4, block_n=32, num_warps=8, key_warps=2, stages=2, paged=paged)
    small = MlaDecodeConfig(m_tiles=1, block_n=32, num_warps=2, key_warps=2, stages=2, paged=paged)
    if rows <= 16:
        tried = [m16, small]
    elif rows <= 32:
        tried = [m32, m32_163, small]
    else:
        tried = [m64, m64_163, m32_163, small]
    for config in tried:
        if config.shared_bytes <= limit:
            return config
    raise RuntimeError(f"no MLA decode config fits in {limit} bytes of shared memory a CTA")


def mla_decode_configs_for(capability: tuple[int, int]) -> list:
    """The MLA decode configs a GPU of ``capability`` dispatches (16, 32 and 64 rows, contiguous or
    paged), each once."""
    found = []
    for rows in (16, 32, 64):
        for paged in (False, True):
            config = mla_decode_config(capability, rows, paged)
            if config not in found:
                found.append(config)
    return found


def decode_configs_for(capability: tuple[int, int]) -> list:
    """The decode configs a GPU of ``capability`` dispatches: each head dim, 16 or more packed
    rows, contiguous, paged by rows or by tiles (pages of 256 rows: every tile divides them), a
    grid within the SMs or wider; each once, in that order."""
    found = []
    for d in SUPPORTED_HEAD_DIMS:
        for rows in (16, 32):
            for paged, page_size in ((False, 0), (True, 0), (True, 256)):
                for wide in (False, True):
                    try:
                        config = decode_config(capability, d, rows, paged, wide=wide, page_size=page_size)
                    except RuntimeError:  # nothing of this head dim fits the GPU's shared memory
                        continue
                    if config not in found:
                        found.append(config)
    return found


def shipped_decode_configs() -> list:
    """Every decode config the representative GPUs can launch (``decode_configs_for`` each),
    each once."""
    shipped = []
    for cap in (*FAMILY_CAPABILITY.values(), *SMALL_SHARED_CAPABILITIES):
        shipped += [c for c in decode_configs_for(cap) if c not in shipped]
    return shipped


def shipped_mla_decode_configs() -> list:
    """Every MLA decode config the representative GPUs can launch (``mla_decode_configs_for``
    each), each once."""
    shipped = []
    for cap in (*FAMILY_CAPABILITY.values(), *SMALL_SHARED_CAPABILITIES):
        shipped += [c for c in mla_decode_configs_for(cap) if c not in shipped]
    return shipped
