"""The forward kernels' launches: one function per family, from a ``ForwardCall`` (the operands
and scalars of one launch) to the kernel's arguments, by name, in their declared order
(``kernels.params``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..kernels import params
from ..kernels.params import ordered
from ..kernels.shapes import block_columns

if TYPE_CHECKING:
    from ..operands import Operand

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535

# Tests set this to launch the folded grid on small problems (the path batch > 65535 takes).
FOLD_GRID = False


class ForwardCall(NamedTuple):
    """One forward launch: q, k, v, out as operands (pointers and strides), the LSE as
    ``(pointer, elements)`` (a scratch scalar when ``write_lse`` is False), the keys and KV heads
    the kernel sees, and the stream; for the mma.sync family's window and softcap kernels, the
    window's sides (each >= 0; ``forward.WINDOW_UNBOUNDED`` for -1) and softmax_scale / softcap
    (``scale_log2`` is then softcap·log2(e)). Other kernels do not read those three. ``sink``: a
    learnable sink's float32 (heads_q,) logits as ``(pointer, elements)``, for a sink kernel
    (``KernelSpec.sink``; its parameter list ends with ``params.SINK``), else None."""

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
    window_left: int = 0
    window_right: int = 0
    cap_scale: np.float32 = np.float32(0.0)
    sink: tuple[int, int] | None = None


def with_sink(declared: tuple, call: ForwardCall) -> tuple:
    """A kernel's declared parameters with a sink call's ``params.SINK`` last (what its kernel
    takes: ``kernels.families.kernel_params``)."""
    return declared + params.SINK if call.sink is not None else declared


def sink_value(call: ForwardCall) -> dict[str, Any]:
    """The sink's argument of a sink call (by name), else none."""
    return {} if call.sink is None else {"sink": call.sink}


def sink_pointer(call: ForwardCall) -> tuple[int, ...]:
    """The sink's device pointer, the last of a sink call's fire arguments; else none."""
    return () if call.sink is None else (call.sink[0],)


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


class ForwardLaunch:
    """One config's launch. ``bind(launcher, call, gpu)`` works out everything of ``call`` but its
    memory once and gives ``fire(stream, q, k, v, o, lse)``, which launches on that stream with
    those device pointers any call of ``call``'s layout (shapes, strides, dtype, LSE size,
    scalars, device): what the hot path keeps (``operations.forward.DevicePlan``). Called as
    ``launch(launcher, call, gpu)``, it binds and fires ``call`` once. A sink call's fire takes the
    sink's pointer last: ``fire(stream, q, k, v, o, lse, sink)``."""

    __slots__ = ("bind",)

    def __init__(self, bind: Callable[[Any, ForwardCall, Any], Callable[..., None]]) -> None:
        self.bind = bind

    def __call__(self, launcher, call: ForwardCall, gpu: Any) -> None:
        self.bind(launcher, call, gpu)(call.stream, call.q.pointer, call.k.pointer, call.v.pointer,
                                       call.o.pointer, call.lse[0], *sink_pointer(call))


def _sm80_values(call: ForwardCall) -> dict[str, Any]:
    """The mma.sync forward's arguments of ``call`` but seqlen_q, batch_size and heads_q (by
    parameter name, ``kernels.params.FORWARD``): the operands as (pointer, elements), their
    strides, and the scalars."""
    values = {name: (op.pointer, op.span) for name, op in zip("qkvo", (call.q, call.k, call.v, call.o),
                                                              strict=True)}
    for name, op in zip("qkvo", (call.q, call.k, call.v, call.o), strict=True):
        values.update(zip((f"{name}_sb", f"{name}_ss", f"{name}_sh"), op.strides[:3], strict=True))
    return {**values, "lse": call.lse, "seqlen_k": call.seqlen_k, "group": call.q.shape[2] // call.heads_kv,
            **_scalars(call), **sink_value(call)}


def _scalars(call: ForwardCall) -> dict[str, Any]:
    """The exponent factor, the LSE flag, the window's sides and the softcap's factor of ``call``."""
    return {"scale_log2": call.scale_log2, "write_lse": call.write_lse, "window_left": call.window_left,
            "window_right": call.window_right, "cap_scale": call.cap_scale}


def launch_sm80(config) -> ForwardLaunch:
    """The launch of the mma.sync kernel of ``config`` (``FORWARD_ABI``; every variant of it, window
    and softcap included): pointers and strides of q, k, v, o; one CTA per query block, head and
    batch. What depends only on the config is
    worked out here, once; what depends on the layout, once per bind."""
    block_m, threads, shared_bytes = config.block_m, config.threads, config.shared_bytes

    def bind(launcher, call: ForwardCall, gpu: Any) -> Callable[..., None]:
        batch, seqlen_q, heads_q, _ = call.q.shape
        grid = forward_grid(-(-seqlen_q // block_m), heads_q, batch)
        args = ordered(with_sink(params.FORWARD, call), **_sm80_values(call), seqlen_q=seqlen_q,
                       batch_size=batch, heads_q=heads_q)
        return launcher.bind(grid, threads, shared_bytes, *args)

    return ForwardLaunch(bind)


class VarlenCall(NamedTuple):
    """One packed variable-length forward launch (``flash_attention_varlen``): ``call`` holds q,
    k, v, out as (1, total, heads, head_dim) operands (their batch strides are never read), the
    LSE (``(pointer, heads_q * total_q)``, or the scratch scalar), max_seqlen_k as its seqlen_k,
    and the scalars; ``cu_seqlens_q`` / ``cu_seqlens_k`` are the int32 offsets as ``(pointer,
    batch + 1)``, ``batch`` the number of sequences, ``max_seqlen_q`` what the grid covers."""

    call: ForwardCall
    cu_seqlens_q: tuple[int, int]
    cu_seqlens_k: tuple[int, int]
    batch: int
    max_seqlen_q: int


class VarlenLaunch:
    """One config's packed variable-length launch, as ``ForwardLaunch``: ``bind(launcher,
    varlen_call, gpu)`` gives ``fire(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)`` for
    every call of that layout (device pointers; a sink call's sink pointer last); called, it binds
    and fires one ``VarlenCall``."""

    __slots__ = ("bind",)

    def __init__(self, bind: Callable[[Any, VarlenCall, Any], Callable[..., None]]) -> None:
        self.bind = bind

    def __call__(self, launcher, vcall: VarlenCall, gpu: Any) -> None:
        call = vcall.call
        self.bind(launcher, vcall, gpu)(call.stream, call.q.pointer, call.k.pointer, call.v.pointer,
                                        call.o.pointer, call.lse[0], vcall.cu_seqlens_q[0],
                                        vcall.cu_seqlens_k[0], *sink_pointer(call))


def varlen_grid(block_m: int, max_seqlen_q: int, heads_q: int, batch: int) -> tuple[int, int, int]:
    """The packed variable-length launch's grid: ceil(max_seqlen_q / block_m) query blocks x heads
    x sequences (``forward_grid``); a CTA whose block lies past its own sequence's end returns."""
    return forward_grid(-(-max_seqlen_q // block_m), heads_q, batch)


def launch_sm80_varlen(config) -> VarlenLaunch:
    """The launch of the mma.sync packed variable-length kernel of ``config``
    (``VARLEN_FORWARD_ABI``; a ``VarlenLaunch``): one CTA per query block of max_seqlen_q, head and
    sequence."""
    block_m, threads, shared_bytes = config.block_m, config.threads, config.shared_bytes

    def bind(launcher, vcall: VarlenCall, gpu: Any) -> Callable[..., None]:
        call = vcall.call
        _, total_q, heads_q, _ = call.q.shape
        grid = varlen_grid(block_m, vcall.max_seqlen_q, heads_q, vcall.batch)
        args = ordered(with_sink(params.VARLEN_FORWARD, call), **_sm80_values(call),
                       seqlen_q=vcall.max_seqlen_q, batch_size=vcall.batch, heads_q=heads_q,
                       cu_seqlens_q=vcall.cu_seqlens_q, cu_seqlens_k=vcall.cu_seqlens_k,
                       lse_head_stride=total_q)
        return launcher.bind(grid, threads, shared_bytes, *args)

    return VarlenLaunch(bind)


def tma_strides(op: Operand) -> list[int]:
    """Byte strides for a tensor map: a size-1 dimension's stride is never used, so a 0 there
    (broadcast) becomes the extent of the dimensions inside it."""
    strides, inner = [], 2 * op.shape[3]
    for n, st in zip(reversed(op.shape[:3]), reversed(op.strides[:3]), strict=True):
        strides.append(2 * st if st or n > 1 else inner)
        inner = strides[-1] * n
    return [*reversed(strides), 2]


_MAP_LAYOUTS: dict[tuple, int] = {}  # (dtype, boxes, shapes and strides of q, k, v, o) -> its id
_MAP_LAYOUT_IDS = itertools.count()
MAP_LAYOUTS_KEPT = 4096


def map_layout_id(layout: tuple) -> int:
    """A small int standing for a tensor-map layout in the map slots' keys (one id for equal
    layouts), so that a launch hashes five ints, not the shapes and strides. Ids are never
    reused: forgetting the layouts (past ``MAP_LAYOUTS_KEPT``) costs misses, never a wrong map."""
    found = _MAP_LAYOUTS.get(layout)
    if found is None:
        if len(_MAP_LAYOUTS) >= MAP_LAYOUTS_KEPT:
            _MAP_LAYOUTS.clear()
        found = _MAP_LAYOUTS.setdefault(layout, next(_MAP_LAYOUT_IDS))
    return found


def _tensor_maps(config, rows: tuple[int, int, int, int] | None = None, k_row_bytes: int = 0):
    """What the Hopper kernels' launches share: ``maps_of(call, gpu)`` gives (the device's SM
    count, the layout's id, its map slots, ``encode(q, k, v, o)``: the four tensor maps of q, k,
    v, out as uint64 words for those pointers). ``call`` needs q, k, v, o (operands) and device.
    ``rows``: the boxes' rows of the four maps (by default the forward's: block_m, block_n,
    block_n, 64; the backward's fourth map is dout's, of block_m rows). ``k_row_bytes``: K's
    swizzle row where it differs from the others' (``WsBackwardConfig.k_row_bytes``)."""
    from ..runtime.map_slots import map_slots

    if rows is None:
        rows = (config.block_m, config.block_n, config.block_n, 64)  # box rows of q, k, v, o
    # one swizzle block a box: 64 columns (128B swizzle) or 32 (64B: head dim 96, the pair's K)
    row_bytes = (config.row_bytes, k_row_bytes or config.row_bytes, config.row_bytes, config.row_bytes)
    cols = tuple(block_columns(config, b) for b in row_bytes)
    sms: dict[int, tuple[int, Any]] = {}  # device -> (SM count, its tensor-map slots)

    def maps_of(call: ForwardCall, gpu: Any):
        q, k, v, o = call.q, call.k, call.v, call.o
        dtype = "bf16" if q.dtype_name == "bfloat16" else "f16"
        layout = map_layout_id((dtype, rows, cols, q.shape, q.strides, k.shape, k.strides, v.shape,
                                v.strides, o.shape, o.strides))
        boxes = [(op.shape, tma_strides(op), (1, r, 1, c), f"{b}B")
                 for op, r, c, b in zip((q, k, v, o), rows, cols, row_bytes, strict=True)]

        def encode(*pointers: int):
            from ..runtime.tensor_map import encode_tensor_map

            return np.stack([encode_tensor_map(pointer, shape, strides, box, swizzle=swizzle, dtype=dtype)
                             for pointer, (shape, strides, box, swizzle) in zip(pointers, boxes,
                                                                                strict=True)])

        device = sms.get(call.device)
        if device is None:
            device = sms[call.device] = (gpu.sm_count(call.device), map_slots(call.device))
        sm_count, slots = device
        return sm_count, layout, slots, encode

    return maps_of


# The four tensor maps' arguments at bind time: 16 words each, their addresses given at each fire.
_MAPS = {"map_q": (0, 16), "map_k": (0, 16), "map_v": (0, 16), "map_o": (0, 16)}


def launch_sm90(config, ctas: int | None = None) -> ForwardLaunch:
    """The launch of the warp-specialised Hopper kernel of ``config`` (``WS_ABI``): tensor maps
    of q, k, v, out (cached in device memory by pointers and layout: ``runtime.map_slots``) and a
    persistent grid of at most one CTA per SM (``ctas``: fewer, for tests that make each CTA walk
    many tiles; one CTA a work unit instead loses 1.5-10.5% on an H200, most at 1k keys:
    docs/PERFORMANCE.md, "Measurements behind dispatch rules"). What depends only on the config
    is worked out here, once; what depends on the layout, once per bind."""
    block_m, threads, shared_bytes = config.block_m, config.threads, config.shared_bytes
    maps_of = _tensor_maps(config)

    def bind(launcher, call: ForwardCall, gpu: Any) -> Callable[..., None]:
        batch, seqlen_q, heads_q, _ = call.q.shape
        sm_count, layout, slots, encode = maps_of(call, gpu)
        tiles = -(-seqlen_q // block_m) * heads_q * batch
        grid = (min(tiles, ctas or sm_count), 1, 1)
        args = ordered(with_sink(params.WS_FORWARD, call), **_MAPS, lse=call.lse, seqlen_q=seqlen_q,
                       seqlen_k=call.seqlen_k, row_lead=config.first_block_lead(seqlen_q), heads_q=heads_q,
                       group=heads_q // call.heads_kv, batch_size=batch, **_scalars(call), **sink_value(call))
        bound = launcher.bind(grid, threads, shared_bytes, *args)
        lock, address, used = slots.lock, slots.address, slots.used

        def fire(stream: int, q: int, k: int, v: int, o: int, lse: int, *sink: int) -> None:
            with lock:
                maps, slot = address((layout, q, k, v, o), lambda: encode(q, k, v, o), stream)
                try:
                    bound(stream, maps, maps + 128, maps + 256, maps + 384, lse, *sink)
                finally:  # even after a failed launch: the slot's copy is on the stream
                    used(slot, stream)

        return fire

    return ForwardLaunch(bind)


def launch_sm90_varlen(config, ctas: int | None = None) -> VarlenLaunch:
    """The launch of the Hopper kernel's packed variable-length build of ``config``
    (``VARLEN_WS_ABI``; a ``VarlenLaunch``). Tensor maps over the (1, total, heads, head_dim) views; a
    persistent grid over ceil(max_seqlen_q / block_m) blocks of every (sequence, head), whose
    blocks past a sequence's end the kernel passes over; out also as a flat array with its row and
    head strides, where the threads store O."""
    block_m, threads, shared_bytes = config.block_m, config.threads, config.shared_bytes
    maps_of = _tensor_maps(config)

    def bind(launcher, vcall: VarlenCall, gpu: Any) -> Callable[..., None]:
        call = vcall.call
        _, total_q, heads_q, _ = call.q.shape
        sm_count, layout, slots, encode = maps_of(call, gpu)
        tiles = -(-vcall.max_seqlen_q // block_m) * heads_q * vcall.batch
        grid = (max(1, min(tiles, ctas or sm_count)), 1, 1)
        o = call.o
        args = ordered(with_sink(params.VARLEN_WS_FORWARD, call), **_MAPS, lse=call.lse,
                       seqlen_q=vcall.max_seqlen_q, seqlen_k=call.seqlen_k, row_lead=0, heads_q=heads_q,
                       group=heads_q // call.heads_kv,
                       batch_size=vcall.batch, **_scalars(call), cu_seqlens_q=vcall.cu_seqlens_q,
                       cu_seqlens_k=vcall.cu_seqlens_k, total_q=total_q, o=(o.pointer, o.span),
                       o_row_stride=o.strides[1], o_head_stride=o.strides[2], **sink_value(call))
        bound = launcher.bind(grid, threads, shared_bytes, *args)
        lock, address, used = slots.lock, slots.address, slots.used

        def fire(stream: int, q: int, k: int, v: int, o: int, lse: int, cu_q: int, cu_k: int,
                 *sink: int) -> None:
            with lock:
                maps, slot = address((layout, q, k, v, o), lambda: encode(q, k, v, o), stream)
                try:
                    bound(stream, maps, maps + 128, maps + 256, maps + 384, lse, cu_q, cu_k, o, *sink)
                finally:  # even after a failed launch: the slot's copy is on the stream
                    used(slot, stream)

        return fire

    return VarlenLaunch(bind)
