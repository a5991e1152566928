"""The forward kernels' launches: one function per family, from a ``ForwardCall`` (the operands
and scalars of one launch) to the kernel's parameter list (``kernels.abi``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ..operands import Operand

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535

# Tests set this to launch the folded grid on small problems (the path batch > 65535 takes).
FOLD_GRID = False


class ForwardCall(NamedTuple):
    """One forward launch: q, k, v, out as operands (pointers and strides), the LSE as
    ``(pointer, elements)`` (a scratch scalar when ``write_lse`` is False), the keys and KV heads
    the kernel sees, and the stream."""

    q: Operand
    k: Operand
    v: Operand
    o: Operand
    lse: tuple[int, int]
    seqlen_k: int
    heads_kv: int
    scale_log2: np.float32
    write_lse: bool
    stream: int
    device: int


def forward_grid(m_blocks: int, heads_q: int, batch: int) -> tuple[int, int, int]:
    """(query blocks, y, z). Normally y = heads_q and z = batch, which the kernel reads off its
    block index. Past 65535 of either (CUDA's limit for y and z) the (batch, head) pairs are
    numbered head-fastest over y and z (``blocks.query_block`` unfolds them with two divisions;
    spare CTAs return)."""
    if heads_q <= MAX_GRID_YZ and batch <= MAX_GRID_YZ and not FOLD_GRID:
        y, z = heads_q, batch
    else:
        pairs = heads_q * batch
        y = min(pairs, MAX_GRID_YZ)
        z = -(-pairs // y)
    if m_blocks > MAX_GRID_X or z > MAX_GRID_YZ:
        raise ValueError(
            f"batch * heads_q = {heads_q * batch} with {m_blocks} query blocks exceeds the CUDA grid "
            f"({MAX_GRID_X} x {MAX_GRID_YZ} x {MAX_GRID_YZ} blocks); split the call"
        )
    return m_blocks, y, z


def launch_sm80(config) -> Callable[[Any, ForwardCall, Any], None]:
    """The launch of the mma.sync kernel of ``config`` (``FORWARD_ABI``): pointers and strides of
    q, k, v, o; one CTA per query block, head and batch. What depends only on the config is
    worked out here, once."""
    block_m, threads, shared_bytes = config.block_m, config.threads, config.shared_bytes

    def launch(launcher, call: ForwardCall, gpu: Any) -> None:
        q, k, v, o = call.q, call.k, call.v, call.o
        batch, seqlen_q, heads_q, _ = q.shape
        grid = forward_grid(-(-seqlen_q // block_m), heads_q, batch)
        qs, ks, vs, os_ = q.strides, k.strides, v.strides, o.strides
        launcher(grid, threads, call.stream, shared_bytes,
                 (q.pointer, q.span), (k.pointer, k.span), (v.pointer, v.span), (o.pointer, o.span), call.lse,
                 qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2],
                 seqlen_q, call.seqlen_k, batch, heads_q, heads_q // call.heads_kv, call.scale_log2,
                 call.write_lse)

    return launch


def tma_strides(op: Operand) -> list[int]:
    """Byte strides for a tensor map: a size-1 dimension's stride is never used, so a 0 there
    (broadcast) becomes the extent of the dimensions inside it."""
    strides, inner = [], 2 * op.shape[3]
    for n, st in zip(reversed(op.shape[:3]), reversed(op.strides[:3]), strict=True):
        strides.append(2 * st if st or n > 1 else inner)
        inner = strides[-1] * n
    return [*reversed(strides), 2]


def launch_sm90(config, ctas: int | None = None) -> Callable[[Any, ForwardCall, Any], None]:
    """The launch of the warp-specialised Hopper kernel of ``config`` (``WS_ABI``): tensor maps
    of q, k, v, out (cached in device memory by pointer, shape and strides:
    ``runtime.map_slots``) and a persistent grid of at most one CTA per SM (``ctas``: fewer, for
    tests that make each CTA walk many tiles). What depends only on the config is worked out
    here, once."""
    from ..runtime.map_slots import map_slots

    block_m, threads, shared_bytes = config.block_m, config.threads, config.shared_bytes
    rows = (config.block_m, config.block_n, config.block_n, 64)  # box rows of q, k, v, o
    cols = config.box_cols  # one swizzle block: 64 columns (128B swizzle) or 32 (64B, head dim 96)
    swizzle = f"{config.row_bytes}B"
    sms: dict[int, tuple[int, Any]] = {}  # device -> (SM count, its tensor-map slots)

    def launch(launcher, call: ForwardCall, gpu: Any) -> None:
        q, k, v, o = call.q, call.k, call.v, call.o
        batch, seqlen_q, heads_q, _ = q.shape
        dtype = "bf16" if q.dtype_name == "bfloat16" else "f16"
        key = (dtype, rows, cols, q.pointer, q.shape, q.strides, k.pointer, k.shape, k.strides,
               v.pointer, v.shape, v.strides, o.pointer, o.shape, o.strides)

        def encode():
            from ..runtime.tensor_map import encode_tensor_map

            return np.stack([encode_tensor_map(op.pointer, op.shape, tma_strides(op), (1, r, 1, cols),
                                               swizzle=swizzle, dtype=dtype)
                             for op, r in zip((q, k, v, o), rows, strict=True)])

        device = sms.get(call.device)
        if device is None:
            device = sms[call.device] = (gpu.sm_count(call.device), map_slots(call.device))
        sm_count, slots = device
        tiles = -(-seqlen_q // block_m) * heads_q * batch
        grid = (min(tiles, ctas or sm_count), 1, 1)
        with slots.lock:
            maps, slot = slots.address(key, encode, call.stream)
            try:
                launcher(grid, threads, call.stream, shared_bytes,
                         (maps, 16), (maps + 128, 16), (maps + 256, 16), (maps + 384, 16), call.lse,
                         seqlen_q, call.seqlen_k, config.first_block_lead(seqlen_q), heads_q,
                         heads_q // call.heads_kv, batch, call.scale_log2, call.write_lse)
            finally:  # even after a failed launch: the slot's copy is on the stream
                slots.used(slot, call.stream)

    return launch
