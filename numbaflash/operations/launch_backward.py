"""The backward kernels' launches: from a ``BackwardCall`` (the operands, the workspace and the
scalars of one call) to each kernel's parameter list (``kernels.abi``: ``BACKWARD_PREP_ABI``,
``BACKWARD_ABI``, ``BACKWARD_DQ_ABI``), and the grid and workspace arithmetic they share.

One call launches three kernels on the caller's stream, in this order:

1. prepare (``backward_prep``): D = rowsum(dO ∘ O) and the LSE in log2 units per row; zeroes
   the dQ accumulator and the turn counters; with a learnable sink, adds d_sink (its sink
   build). Grid (rows // 64, heads_q, batch), 128 threads.
2. main (``backward``): dK and dV of one key block per CTA, dQ added into the accumulator.
   Grid ceil(seqlen_k / block_n) * heads_kv * batch in one dimension, in the launch order of
   ``kernels.blocks.key_block_of`` (``backward_tail_pairs``), ``config.threads``,
   ``config.shared_bytes``.
3. dQ (``backward_dq``): the accumulator, scaled, in the input dtype. Grid (ceil(seqlen_q /
   block_m), heads_q, batch), ``config.threads``.

On Hopper at head dims 64 and 128 the main kernel is the warp-specialised one
(``launch_backward_ws_main``: tensor maps of q, k, v, dout instead of their pointers and strides,
the same grid, times the CTAs each GQA group is split over where the grid is small:
``backward_group_splits``); its prepare and dQ kernels are the mma.sync ones of
``config.dq_config()``.

A packed variable-length call (``VarlenBackwardCall``) launches the varlen builds of the three
(``launch_varlen_backward_*``) over grids of the maxima, with a workspace of
``varlen_workspace_layout`` (each sequence's rows from ``abi.varlen_row_offset``, padded to
whole 128-row blocks).

rows = seqlen_q rounded up to ``BACKWARD_ROW_ALIGN`` (or more: ``backward_rows``). The prepare
and dQ grids are not folded as the forward's is: y and z are the head and the batch, each at most 65535
(``check_backward_grid``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..kernels.abi import BACKWARD_ROW_ALIGN, varlen_workspace_rows
from ..kernels.shapes import PREP_ROWS, PREP_THREADS
from .launch_forward import MAX_GRID_X, MAX_GRID_YZ, _tensor_maps

if TYPE_CHECKING:
    from ..operands import Operand

SMALLEST_BLOCK_N = 16  # the narrowest key block any BackwardConfig may have (a 16-key mma tile)


class Workspace(NamedTuple):
    """Where one call's float32 workspace sits, each part as ``(device pointer, elements)``,
    flat 1-D: the LSE in log2 units and D, (batch, heads_q, rows) float32 each; the dQ
    accumulator, (batch, heads_q, rows, head_dim) float32, each query block in the main kernel's
    fragment order (``BackwardConfig.dq_position``); the turn counters, (batch, heads_q,
    rows // block_m) int32. Where the Hopper backward splits GQA groups over CTAs
    (``backward_group_splits`` > 1), also the dK and dV sums, float32, per key block of every
    (batch, KV head) its dK then its dV in the consumer threads' fragment order, and one int32
    ticket per key block (both zeroed by the main kernel's launch); else (0, 0) each."""

    lse_log2: tuple[int, int]
    delta: tuple[int, int]
    dq_accum: tuple[int, int]
    counters: tuple[int, int]
    dkv_accum: tuple[int, int] = (0, 0)
    tickets: tuple[int, int] = (0, 0)


class WorkspaceLayout(NamedTuple):
    """The workspace of one problem as one float32 allocation (4-byte elements throughout; the
    int32 counters come last): each part's offset and length in elements, and the total."""

    rows: int
    lse_log2: int
    delta: int
    dq_accum: int
    counters: int
    row_elements: int  # batch * heads_q * rows: the length of lse_log2 and of delta
    accum_elements: int  # row_elements * head_dim
    counter_elements: int  # batch * heads_q * (rows // block_m)
    total: int
    # A split GQA group's dK and dV sums and tickets (``Workspace``), after the counters: offsets
    # and lengths, the lengths 0 where no group is split.
    dkv_accum: int = 0
    tickets: int = 0
    dkv_elements: int = 0  # key blocks (of every batch and KV head) * 2 * block_n * head_dim
    ticket_elements: int = 0  # key blocks (of every batch and KV head)

    def at(self, base: int) -> Workspace:
        """The parts of a workspace allocated at device address ``base``."""
        split = () if not self.dkv_elements else ((base + 4 * self.dkv_accum, self.dkv_elements),
                                                  (base + 4 * self.tickets, self.ticket_elements))
        return Workspace((base + 4 * self.lse_log2, self.row_elements),
                         (base + 4 * self.delta, self.row_elements),
                         (base + 4 * self.dq_accum, self.accum_elements),
                         (base + 4 * self.counters, self.counter_elements), *split)


def backward_rows(seqlen_q: int, block_m: int = BACKWARD_ROW_ALIGN) -> int:
    """The workspace's rows per (batch, head): seqlen_q rounded up to ``BACKWARD_ROW_ALIGN`` (128),
    or for query blocks of ``block_m`` rows that do not divide it (the Hopper backward's 80) to a
    multiple of both (640), so that the prepare kernel's 64-row blocks and the query blocks both
    tile the rows."""
    align = BACKWARD_ROW_ALIGN
    if BACKWARD_ROW_ALIGN % block_m and block_m % BACKWARD_ROW_ALIGN:
        align = math.lcm(BACKWARD_ROW_ALIGN, block_m)
    return -(-seqlen_q // align) * align


def workspace_layout(batch: int, heads_q: int, seqlen_q: int, head_dim: int, block_m: int,
                     split_blocks: int = 0, block_n: int = 0) -> WorkspaceLayout:
    """The workspace of a problem of q shape (batch, seqlen_q, heads_q, head_dim) for a config
    of ``block_m`` query rows a step. Every part up to the counters starts at a multiple of 512
    bytes (rows is a multiple of 128 rows of 4 bytes).

    ``split_blocks``: where the Hopper backward splits GQA groups over CTAs, its key blocks of
    ``block_n`` keys over every (batch, KV head) (ceil(seqlen_k / block_n) * heads_kv * batch),
    whose dK and dV sums (2 * block_n * head_dim float32 each, from a multiple of 16 bytes) and
    tickets (int32) follow the counters; 0: none."""
    rows = backward_rows(seqlen_q, block_m)
    if rows % block_m:
        raise ValueError(f"block_m ({block_m}) must divide the workspace's {rows} rows "
                         f"(seqlen_q rounded up to {BACKWARD_ROW_ALIGN})")
    row_elements = batch * heads_q * rows
    accum_elements = row_elements * head_dim
    counter_elements = batch * heads_q * (rows // block_m)
    delta = row_elements
    dq_accum = 2 * row_elements
    counters = dq_accum + accum_elements
    end = counters + counter_elements
    if not split_blocks:
        return WorkspaceLayout(rows, 0, delta, dq_accum, counters, row_elements, accum_elements,
                               counter_elements, end)
    dkv_accum = -(-end // 4) * 4  # 16-byte aligned: the sums take 16-byte reductions
    dkv_elements = split_blocks * 2 * block_n * head_dim
    tickets = dkv_accum + dkv_elements
    return WorkspaceLayout(rows, 0, delta, dq_accum, counters, row_elements, accum_elements, counter_elements,
                           tickets + split_blocks, dkv_accum, tickets, dkv_elements, split_blocks)


def backward_grids(seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, batch: int,
                   block_n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid of the prepare and dQ kernels, grid of the main kernel); ValueError where either
    exceeds CUDA's grid (x at most 2^31 - 1, y and z at most 65535)."""
    rows_grid = (backward_rows(seqlen_q) // PREP_ROWS, heads_q, batch)
    main_grid = (-(-seqlen_k // block_n) * heads_kv * batch, 1, 1)
    if rows_grid[0] > MAX_GRID_X or rows_grid[1] > MAX_GRID_YZ or rows_grid[2] > MAX_GRID_YZ:
        raise ValueError(
            f"the backward's prepare and dQ grid {rows_grid} (blocks, heads, batch) exceeds the CUDA "
            f"grid ({MAX_GRID_X} x {MAX_GRID_YZ} x {MAX_GRID_YZ} blocks): the backward needs heads_q and "
            f"batch each at most {MAX_GRID_YZ}, got heads_q {heads_q}, batch {batch}; split the call"
        )
    if main_grid[0] > MAX_GRID_X:
        raise ValueError(
            f"the backward's main grid needs ceil(seqlen_k / {block_n}) * heads_kv * batch = "
            f"{main_grid[0]} blocks, more than CUDA's {MAX_GRID_X}: got seqlen_k {seqlen_k}, heads_kv "
            f"{heads_kv}, batch {batch}; split the call"
        )
    return rows_grid, main_grid


def backward_tail_pairs(key_blocks: int, pairs: int, sm_count: int) -> int:
    """How many of the main kernel's (batch, KV head) pairs launch interleaved at its end
    (``kernels.blocks.key_block_of``; the causal kernels only): enough for two waves of CTAs
    (``2 * sm_count``), at most all of them."""
    return min(pairs, -(-2 * sm_count // max(key_blocks, 1)))


def backward_group_splits(key_blocks: int, heads_kv: int, batch: int, group: int, sm_count: int,
                          deterministic: bool) -> int:
    """Over how many CTAs the Hopper backward's main kernel splits each GQA group's ``group`` query
    heads (``kernels.backward_ws``): 1 in deterministic mode (a split's dK and dV are sums of
    float32 reductions in no fixed order) and where the grid of ``key_blocks * heads_kv * batch``
    CTAs already fills two waves of ``sm_count`` SMs; else the smallest divisor of ``group`` whose
    grid fills them, or ``group``. Two waves: with causal masking key block 0's CTA does about
    twice the mean work, so one wave ends on it (batch 1, seqlen 4096, 16 / 4 heads, d128: 128
    CTAs on 132 SMs ran 1.4x cuDNN's time).

    Invariants (``tests/test_backward_gqa_split_cpu.py``): the result divides ``group``; 1 in
    deterministic mode; non-increasing in ``key_blocks``, ``heads_kv`` and ``batch``,
    non-decreasing in ``sm_count``."""
    ctas = key_blocks * heads_kv * batch
    if deterministic or group <= 1 or ctas >= 2 * sm_count:
        return 1
    for splits in range(2, group):
        if group % splits == 0 and ctas * splits >= 2 * sm_count:
            return splits
    return group


def check_backward_grid(seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, batch: int) -> None:
    """Whether every config's grids fit, before any config is chosen (the narrowest key block
    gives the most blocks): what the API checks before anything is compiled."""
    backward_grids(seqlen_q, seqlen_k, heads_q, heads_kv, batch, SMALLEST_BLOCK_N)


class BackwardCall(NamedTuple):
    """One backward call: dout, q, k, v, out and the gradients dq, dk, dv as operands (pointers
    and strides in elements, 16-bit), the forward's LSE as ``(pointer, elements)`` (float32,
    (batch, heads_q, seqlen_q), contiguous), the workspace, the scalars and the stream."""

    dout: Operand
    q: Operand
    k: Operand
    v: Operand
    out: Operand
    dq: Operand
    dk: Operand
    dv: Operand
    lse: tuple[int, int]
    workspace: Workspace
    rows: int  # seqlen_q rounded up to BACKWARD_ROW_ALIGN
    scale_log2: np.float32  # softmax scale * log2(e) (softcap * log2(e) with a softcap)
    scale: np.float32  # softmax scale
    deterministic: bool
    stream: int
    device: int
    # A window kernel's sides (each >= 0, ``forward.WINDOW_UNBOUNDED`` for -1) and a softcap
    # kernel's softmax_scale / softcap (``forward.variant_of``); other kernels never read them.
    window_left: int = 0
    window_right: int = 0
    cap_scale: np.float32 = np.float32(0.0)
    # A learnable sink's float32 (heads_q,) logits and its zeroed gradient, each as ``(pointer,
    # elements)``: the prepare kernel's sink build (``params.SINK_GRADIENT``) adds d_sink; None
    # without a sink.
    sink: tuple[int, int] | None = None
    d_sink: tuple[int, int] | None = None
    # Over how many CTAs the Hopper backward's main kernel splits each GQA group
    # (``backward_group_splits``; the workspace then holds the dK and dV sums); the mma.sync
    # backward never splits (1).
    group_splits: int = 1


def sink_arguments(call: BackwardCall) -> tuple:
    """The prepare kernel's last arguments: a sink call's logits and d_sink, else none."""
    return () if call.sink is None else (call.sink, call.d_sink)


class Launch:
    """One config's launch of one backward kernel from a ``BackwardCall``. ``arguments(call, gpu)``
    gives (grid, threads, shared bytes, the kernel's arguments in declared order). Called as
    ``launch(launcher, call, gpu)``, it launches ``call`` once (the numpy path's); ``bind(launcher,
    call, gpu)`` gives ``fire(stream, *pointers)``, the same launch for every call of ``call``'s
    layout (shapes, strides, scalars, device) given its array arguments' device pointers in
    parameter order (``KernelLauncher.bind``): what the backward's plans keep
    (``operations.backward.BackwardPlan``)."""

    __slots__ = ("arguments",)

    def __init__(self, arguments: Callable[[BackwardCall, Any], tuple]) -> None:
        self.arguments = arguments

    def __call__(self, launcher, call: BackwardCall, gpu: Any) -> None:
        grid, threads, shared, args = self.arguments(call, gpu)
        launcher(grid, threads, call.stream, shared, *args)

    def bind(self, launcher, call: BackwardCall, gpu: Any) -> Callable[..., None]:
        grid, threads, shared, args = self.arguments(call, gpu)
        return launcher.bind(grid, threads, shared, *args)


def launch_backward_prep(config) -> Launch:
    """The launch of the prepare kernel (``BACKWARD_PREP_ABI``): out and dout by pointer and
    strides, the LSE, and the four workspace parts it initialises (a bound launch's pointers: out,
    dout, lse, delta, lse2, dq_acc, counters; a sink call's sink and d_sink after them)."""
    block_m = config.block_m

    def arguments(call: BackwardCall, gpu: Any) -> tuple:
        o, do, ws = call.out, call.dout, call.workspace
        batch, seqlen_q, heads_q, _ = call.q.shape
        os_, ds = o.strides, do.strides
        return ((call.rows // PREP_ROWS, heads_q, batch), PREP_THREADS, 0,
                ((o.pointer, o.span), (do.pointer, do.span), call.lse,
                 ws.delta, ws.lse_log2, ws.dq_accum, ws.counters,
                 os_[0], os_[1], os_[2], ds[0], ds[1], ds[2],
                 seqlen_q, call.rows, heads_q, call.rows // block_m, *sink_arguments(call)))

    return Launch(arguments)


def launch_backward_main(config) -> Launch:
    """The launch of the main kernel (``BACKWARD_ABI``): one CTA per key block, KV head and
    batch; q, k, v, dout, dk, dv by pointer and strides, the workspace, and the scalars (a bound
    launch's pointers: q, k, v, dout, dk, dv, lse2, delta, dq_acc, counters). What depends only on
    the config is worked out here, once."""
    block_n, threads, shared_bytes = config.block_n, config.threads, config.shared_bytes

    def arguments(call: BackwardCall, gpu: Any) -> tuple:
        q, k, v, do, dk, dv, ws = call.q, call.k, call.v, call.dout, call.dk, call.dv, call.workspace
        batch, seqlen_q, heads_q, _ = q.shape
        _, seqlen_k, heads_kv, _ = k.shape
        key_blocks = -(-seqlen_k // block_n)
        tail_pairs = backward_tail_pairs(key_blocks, heads_kv * batch, gpu.sm_count(call.device))
        qs, ks, vs, dos, dks, dvs = q.strides, k.strides, v.strides, do.strides, dk.strides, dv.strides
        return ((key_blocks * heads_kv * batch, 1, 1), threads, shared_bytes,
                ((q.pointer, q.span), (k.pointer, k.span), (v.pointer, v.span), (do.pointer, do.span),
                 (dk.pointer, dk.span), (dv.pointer, dv.span),
                 ws.lse_log2, ws.delta, ws.dq_accum, ws.counters,
                 qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                 dos[0], dos[1], dos[2], dks[0], dks[1], dks[2], dvs[0], dvs[1], dvs[2],
                 seqlen_q, seqlen_k, call.rows, heads_q, heads_q // heads_kv, heads_kv, tail_pairs,
                 call.scale_log2, call.scale, call.deterministic, call.window_left, call.window_right,
                 call.cap_scale))

    return Launch(arguments)


class _MapOperands(NamedTuple):
    """What ``launch_forward._tensor_maps`` reads of a call: the four operands its maps cover (the
    backward's: q, k, v and dout, in the forward's ``o`` place) and the device."""

    q: Operand
    k: Operand
    v: Operand
    o: Operand
    device: int


class MappedLaunch(Launch):
    """The Hopper backward main kernel's ``Launch``: its first four arguments are the tensor maps
    of q, k, v and dout, whose device address (``maps``, then + 128, + 256, + 384) each launch
    looks up in the device's map slots (``runtime.map_slots``: encoded and copied on the
    launch's stream on a miss, pinned under CUDA-graph capture) with the slots' lock held from
    the lookup to the launch; the slot is marked used after it, a failed launch included (its
    copy is on the stream). ``arguments(call, gpu, maps)`` takes the address; ``maps_of`` is
    ``launch_forward._tensor_maps``' lookup. A bound launch's pointers are the plain main
    kernel's (q, k, v, dout, dk, dv, lse2, delta, dq_acc, counters): its maps are looked up by
    q, k, v, dout at each fire.

    ``split``: the launch of the GQA-split build, whose last array arguments are the workspace's
    dK / dV sums and tickets (a bound launch's pointers end with dkv_acc and tickets): each
    launch, and each fire of a bound one, first zeroes both on its stream (``GPU.zero_words``:
    one ``cuMemsetD32Async`` over the two, which follow each other in the workspace; a memset
    node under CUDA-graph capture), so that the memset is ordered before the kernel."""

    __slots__ = ("maps_of", "split")

    def __init__(self, arguments: Callable[..., tuple], maps_of: Callable[..., tuple],
                 split: bool = False) -> None:
        super().__init__(arguments)
        self.maps_of = maps_of
        self.split = split

    def __call__(self, launcher, call: BackwardCall, gpu: Any) -> None:
        _, layout, slots, encode = self.maps_of(_MapOperands(call.q, call.k, call.v, call.dout,
                                                             call.device), gpu)
        pointers = (call.q.pointer, call.k.pointer, call.v.pointer, call.dout.pointer)
        with slots.lock:
            maps, slot = slots.address((layout, *pointers), lambda: encode(*pointers), call.stream)
            try:
                grid, threads, shared, args = self.arguments(call, gpu, maps)
                if self.split:  # the sums and tickets follow each other in the workspace
                    ws = call.workspace
                    gpu.zero_words(ws.dkv_accum[0], ws.dkv_accum[1] + ws.tickets[1], call.stream)
                launcher(grid, threads, call.stream, shared, *args)
            finally:  # even after a failed launch: the slot's copy is on the stream
                slots.used(slot, call.stream)

    def bind(self, launcher, call: BackwardCall, gpu: Any) -> Callable[..., None]:
        _, layout, slots, encode = self.maps_of(_MapOperands(call.q, call.k, call.v, call.dout,
                                                             call.device), gpu)
        grid, threads, shared, args = self.arguments(call, gpu, 0)
        bound = launcher.bind(grid, threads, shared, *args)
        lock, address, used = slots.lock, slots.address, slots.used
        if not self.split:
            def fire(stream: int, q: int, k: int, v: int, do: int, dk: int, dv: int, lse2: int, delta: int,
                     dq_acc: int, counters: int) -> None:
                with lock:
                    maps, slot = address((layout, q, k, v, do), lambda: encode(q, k, v, do), stream)
                    try:
                        bound(stream, maps, maps + 128, maps + 256, maps + 384, dk, dv, lse2, delta, dq_acc,
                              counters)
                    finally:  # even after a failed launch: the slot's copy is on the stream
                        used(slot, stream)

            return fire

        ws = call.workspace
        words, zero = ws.dkv_accum[1] + ws.tickets[1], gpu.zero_words

        def fire_split(stream: int, q: int, k: int, v: int, do: int, dk: int, dv: int, lse2: int, delta: int,
                       dq_acc: int, counters: int, dkv_acc: int, tickets: int) -> None:
            zero(dkv_acc, words, stream)  # the sums and tickets, on the stream before the kernel
            with lock:
                maps, slot = address((layout, q, k, v, do), lambda: encode(q, k, v, do), stream)
                try:
                    bound(stream, maps, maps + 128, maps + 256, maps + 384, dk, dv, lse2, delta, dq_acc,
                          counters, dkv_acc, tickets)
                finally:  # even after a failed launch: the slot's copy is on the stream
                    used(slot, stream)

        return fire_split


def launch_backward_ws_main(config, split: bool = False) -> Launch:
    """The launch of the Hopper backward's main kernel (``BACKWARD_WS_ABI``; a ``MappedLaunch``): the
    grid, threads and shared memory of ``launch_backward_main``; tensor maps of q, k, v, dout
    (boxes of block_m, block_n, block_n, block_m rows, K's of ``config.k_row_bytes``, cached in
    device memory by pointers and layout as the Hopper forward's: ``runtime.map_slots``) instead
    of their pointers and strides; dk, dv by pointer and strides, the workspace, and the scalars.
    ``split``: the launch of its GQA-split build (``BACKWARD_WS_SPLIT_ABI``,
    ``launch_backward_ws_split``): the grid times ``call.group_splits`` (the CTAs each GQA group
    is split over: ceil(seqlen_k / block_n) * heads_kv * splits * batch), and last the dK / dV
    sums and tickets, zeroed first on the call's stream (``MappedLaunch``'s ``split``), and
    ``splits``. Each build takes only its calls
    (``group_splits`` > 1: the split build; ValueError otherwise, before anything is launched)."""
    block_n, threads, shared_bytes = config.block_n, config.threads, config.shared_bytes
    maps_of = _tensor_maps(config, (config.block_m, block_n, block_n, config.block_m), config.k_row_bytes)

    def arguments(call: BackwardCall, gpu: Any, maps: int) -> tuple:
        q, k, dk, dv, ws = call.q, call.k, call.dk, call.dv, call.workspace
        batch, seqlen_q, heads_q, _ = q.shape
        _, seqlen_k, heads_kv, _ = k.shape
        key_blocks = -(-seqlen_k // block_n)
        splits = call.group_splits
        if (splits > 1) != split:  # the split build writes the sums: only a split call's workspace has them
            raise ValueError(f"a call whose GQA groups are split over {splits} CTAs runs the "
                             f"{'split' if splits > 1 else 'unsplit'} build of the Hopper backward's "
                             f"main kernel")
        pairs = heads_kv * splits * batch
        tail_pairs = backward_tail_pairs(key_blocks, pairs, gpu.sm_count(call.device))
        dks, dvs = dk.strides, dv.strides
        extra = (ws.dkv_accum, ws.tickets, splits) if split else ()
        return ((key_blocks * pairs, 1, 1), threads, shared_bytes,
                ((maps, 16), (maps + 128, 16), (maps + 256, 16), (maps + 384, 16),
                 (dk.pointer, dk.span), (dv.pointer, dv.span),
                 ws.lse_log2, ws.delta, ws.dq_accum, ws.counters,
                 dks[0], dks[1], dks[2], dvs[0], dvs[1], dvs[2],
                 seqlen_q, seqlen_k, call.rows, heads_q, heads_q // heads_kv, heads_kv, tail_pairs,
                 call.scale_log2, call.scale, call.deterministic, call.window_left, call.window_right,
                 call.cap_scale, *extra))

    return MappedLaunch(arguments, maps_of, split)


def launch_backward_ws_split(config) -> Launch:
    """The launch of the GQA-split build of the Hopper backward's main kernel
    (``launch_backward_ws_main`` with ``split``)."""
    return launch_backward_ws_main(config, split=True)


def _dq_config_launch(launch_of: Callable[[Any], Launch]) -> Callable[[Any], Launch]:
    """``launch_of`` (the mma.sync prepare or dQ launch) applied to a Hopper backward config's
    ``dq_config()``: the kernels it shares with the mma.sync backward."""

    def prepare(config) -> Launch:
        return launch_of(config.dq_config())

    prepare.__name__ = prepare.__qualname__ = f"{launch_of.__name__}_of_dq_config"
    return prepare



class VarlenBackwardCall(NamedTuple):
    """One packed variable-length backward call (``flash_attention_varlen_backward``): ``call``
    holds dout, q, k, v, out, dq, dk, dv as (1, total, heads, head_dim) operands (batch strides
    never read), the LSE as ``(pointer, heads_q * total_q)``, the workspace of
    ``varlen_workspace_layout`` and its ``rows``; ``cu_seqlens_q`` / ``cu_seqlens_k`` the int32
    offsets as ``(pointer, batch + 1)``; the maxima span the grids."""

    call: BackwardCall
    cu_seqlens_q: tuple[int, int]
    cu_seqlens_k: tuple[int, int]
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_workspace_layout(total_q: int, batch: int, heads_q: int, head_dim: int,
                            block_m: int) -> WorkspaceLayout:
    """The workspace of a packed call: ``workspace_layout`` of one "batch" of
    ``abi.varlen_workspace_rows(total_q, batch)`` rows per head (sequence b's rows from
    ``abi.varlen_row_offset(cu_seqlens_q[b], b)``, each padded to whole blocks)."""
    rows = varlen_workspace_rows(total_q, batch)
    return workspace_layout(1, heads_q, rows, head_dim, block_m)


def varlen_backward_grids(max_seqlen_q: int, max_seqlen_k: int, heads_q: int, heads_kv: int, batch: int,
                          block_n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid of the varlen prepare kernel, grid of the varlen main kernel): ``backward_grids`` of
    the maxima, with its checks (the dQ kernel's grid is the prepare's with block_m rows a CTA)."""
    return backward_grids(max_seqlen_q, max_seqlen_k, heads_q, heads_kv, batch, block_n)


def launch_varlen_backward_prep(config) -> Callable[..., None]:
    """The launch of the varlen prepare kernel (``VARLEN_BACKWARD_PREP_ABI``)."""
    block_m = config.block_m

    def launch(launcher, vcall: VarlenBackwardCall, gpu: Any) -> None:
        call = vcall.call
        o, do, ws = call.out, call.dout, call.workspace
        _, total_q, heads_q, _ = call.q.shape
        grid = (backward_rows(vcall.max_seqlen_q) // PREP_ROWS, heads_q, vcall.batch)
        os_, ds = o.strides, do.strides
        launcher(grid, PREP_THREADS, call.stream, 0,
                 (o.pointer, o.span), (do.pointer, do.span), call.lse,
                 ws.delta, ws.lse_log2, ws.dq_accum, ws.counters,
                 os_[0], os_[1], os_[2], ds[0], ds[1], ds[2],
                 vcall.max_seqlen_q, call.rows, heads_q, call.rows // block_m,
                 vcall.cu_seqlens_q, vcall.cu_seqlens_k, total_q, *sink_arguments(call))

    return launch


def launch_varlen_backward_main(config) -> Callable[..., None]:
    """The launch of the varlen main kernel (``VARLEN_BACKWARD_ABI``): ceil(max_seqlen_k /
    block_n) key blocks x heads_kv x sequences, in ``key_block_of``'s order."""
    block_n, threads, shared_bytes = config.block_n, config.threads, config.shared_bytes

    def launch(launcher, vcall: VarlenBackwardCall, gpu: Any) -> None:
        call = vcall.call
        q, k, v, do, dk, dv, ws = call.q, call.k, call.v, call.dout, call.dk, call.dv, call.workspace
        _, total_q, heads_q, _ = q.shape
        heads_kv = k.shape[2]
        key_blocks = -(-vcall.max_seqlen_k // block_n)
        pairs = heads_kv * vcall.batch
        tail_pairs = backward_tail_pairs(key_blocks, pairs, gpu.sm_count(call.device))
        qs, ks, vs, dos, dks, dvs = q.strides, k.strides, v.strides, do.strides, dk.strides, dv.strides
        launcher((key_blocks * pairs, 1, 1), threads, call.stream, shared_bytes,
                 (q.pointer, q.span), (k.pointer, k.span), (v.pointer, v.span), (do.pointer, do.span),
                 (dk.pointer, dk.span), (dv.pointer, dv.span),
                 ws.lse_log2, ws.delta, ws.dq_accum, ws.counters,
                 qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                 dos[0], dos[1], dos[2], dks[0], dks[1], dks[2], dvs[0], dvs[1], dvs[2],
                 vcall.max_seqlen_q, vcall.max_seqlen_k, call.rows, heads_q, heads_q // heads_kv, heads_kv,
                 tail_pairs, call.scale_log2, call.scale, call.deterministic, call.window_left,
                 call.window_right, call.cap_scale, vcall.cu_seqlens_q, vcall.cu_seqlens_k, total_q)

    return launch


def launch_varlen_backward_dq(config) -> Callable[..., None]:
    """The launch of the varlen dQ kernel (``VARLEN_BACKWARD_DQ_ABI``)."""
    block_m, threads = config.block_m, config.threads

    def launch(launcher, vcall: VarlenBackwardCall, gpu: Any) -> None:
        call = vcall.call
        dq = call.dq
        _, total_q, heads_q, _ = call.q.shape
        grid = (backward_rows(vcall.max_seqlen_q) // block_m, heads_q, vcall.batch)
        s = dq.strides
        launcher(grid, threads, call.stream, 0,
                 call.workspace.dq_accum, (dq.pointer, dq.span), s[0], s[1], s[2],
                 vcall.max_seqlen_q, call.rows, heads_q, call.scale, vcall.cu_seqlens_q, vcall.cu_seqlens_k,
                 total_q)

    return launch


def launch_backward_dq(config) -> Launch:
    """The launch of the dQ kernel (``BACKWARD_DQ_ABI``): the accumulator, scaled, into dq (by
    pointer and strides); one CTA of the main kernel's ``threads`` per query block of the
    sequence, ceil(seqlen_q / block_m) of them (it reads the accumulator in the main kernel's
    fragment order). Not ``rows // block_m``: a CTA past the last query block stores nothing,
    and at block_m 80 (rows aligned to 640) it read up to 560 rows a head that neither the
    prepare kernel zeroes nor the main kernel adds to (compute-sanitizer's initcheck flagged the
    reads: docs/PERFORMANCE.md [SW64K]). A bound launch's pointers: dq_acc, dq."""

    block_m, threads = config.block_m, config.threads

    def arguments(call: BackwardCall, gpu: Any) -> tuple:
        dq = call.dq
        batch, seqlen_q, heads_q, _ = call.q.shape
        s = dq.strides
        return ((-(-seqlen_q // block_m), heads_q, batch), threads, 0,
                (call.workspace.dq_accum, (dq.pointer, dq.span), s[0], s[1], s[2],
                 seqlen_q, call.rows, heads_q, call.scale))

    return Launch(arguments)


# The Hopper backward's prepare and dQ launches (family sm90bwd): the mma.sync ones of its dq_config().
launch_backward_ws_prep = _dq_config_launch(launch_backward_prep)
launch_backward_ws_dq = _dq_config_launch(launch_backward_dq)
