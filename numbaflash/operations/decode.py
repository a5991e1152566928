"""Decode against a KV cache on device arrays: the config (``configs.decode_config``), its two
kernels loaded once per device (``GPU.launchers``), the split count
(``launch_decode.decode_splits``), the output and the split scratch from the inputs' library,
and the launches on the inputs' stream.

A validated call's layout (device, dtype, flags, scale as given, split request, shapes and
strides of every operand) gets a plan once (``GPU.plans``, as the forward's): the launches bound
with everything but the pointers. torch calls of a known layout then take ``run_torch``: the
per-call checks, the allocations and the fires, no operand descriptions.

A sliding window or a softcap (issue 35) runs a variant of the decode kernel
(``decode_variant``): the window's rule is FlashAttention's with
each sequence's own key count L = cache_seqlens[b] + seqlen_new, read on the device only."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import configs
from ..kernels.families import family_of, kernel_abi
from ..kernels.spec import kernel_spec
from ..operands import (
    FLOAT32,
    TORCH_DTYPE_NAMES,
    TORCH_TYPES,
    Operand,
    device_pointer,
    empty_like,
    empty_lse,
    stream_handle,
    torch_small_pointer,
    torch_stream,
)
from ..runtime import device as gpu_state
from ..runtime.compiler import arch_of
from .forward import PLANS_KEPT, WINDOW_UNBOUNDED, loaded_kernel, variant_of
from .launch_decode import (
    MAX_SPLITS,
    Bind,
    DecodeCall,
    decode_splits,
    occupancy_shared,
    resident_ctas,
    split_scratch_elements,
    streaming_ctas,
)
from .launches import prepare_launch

LOG2_E = math.log2(math.e)


class DecodeVariant(NamedTuple):
    """Which decode kernel a validated call runs, and the arguments that depend on its window and
    softcap (``decode_variant``): whether it is a window and a softcap variant, the ``causal`` its
    kernel is built with,
    the window's sides as the kernel takes them (each >= 0, ``WINDOW_UNBOUNDED`` for -1; 0
    without a window), the exponent factor (softmax_scale·log2(e), or softcap·log2(e)),
    softmax_scale / softcap (0 without), both float32, and the most keys one row block's windows
    reach (None where the left side is unbounded): what the split count is chosen for."""

    window: bool
    softcap: bool
    causal: bool
    window_left: int
    window_right: int
    scale_log2: np.float32
    cap_scale: np.float32
    window_keys: int | None


def decode_variant(causal: bool, window_size: tuple[int, int], softcap: float, softmax_scale: float,
                   seqlen_q: int, max_keys: int) -> DecodeVariant:
    """The decode kernel of a validated call, from the shapes only. ``max_keys``: the most keys a
    sequence may have (the cache's room a sequence plus seqlen_new), the ``seqlen_k`` of
    ``forward.effective_window``: a side that bounds no row of any sequence becomes -1, so that
    (-1, -1) runs the plain kernel, (-1, 0) the causal one, and any other window the window kernel
    (built as non-causal); each with a softcap (> 0) or not. Query i of a sequence of L keys sees
    keys L - seqlen_q + i - left .. L - seqlen_q + i + right, so a row block's keys lie in the
    last left + seqlen_q keys of its sequence: ``window_keys``. The forward's ``variant_of``."""
    var = variant_of(causal, window_size, softcap, softmax_scale, seqlen_q, max_keys)
    window = var.window
    bounded = window and var.window_left != WINDOW_UNBOUNDED
    return DecodeVariant(window, var.softcap, var.causal and not window, var.window_left,
                         var.window_right, var.scale_log2, var.cap_scale,
                         var.window_left + seqlen_q if bounded else None)


class RotaryCall(NamedTuple):
    """A call's rotary embedding (FlashAttention's ``rotary_cos``, ``rotary_sin``,
    ``rotary_interleaved``), validated: the two tables (q's dtype, (seqlen_ro, rotary_dim / 2)),
    the rotary dim, interleaved or halves, and the query rows' position step (``rotary_q_step``)."""

    cos: Operand
    sin: Operand
    dim: int
    interleaved: bool
    q_step: int

    @property
    def kind(self) -> int:
        """The spec's ``rotary``: 1 halves, 2 interleaved."""
        return 2 if self.interleaved else 1


def rotary_q_step(causal: bool, window_size: tuple[int, int], room: int) -> int:
    """FlashAttention's positions of the query rows under a rotary embedding: query i at
    cache_seqlens[b] + i (1) in a causal or windowed call, every query at cache_seqlens[b] (0)
    otherwise; a window side of at least the cache's room (``room``) is none, as FlashAttention
    normalises it."""
    left, right = window_size
    if causal:
        right = 0
    left = -1 if left >= room else left
    right = -1 if right >= room else right
    return int(causal or left >= 0 or right >= 0)


class DecodeKernels(NamedTuple):
    config: Any  # kernels.shapes.DecodeConfig
    decode: tuple[Any, Bind]
    combine: tuple[Any, Bind]
    ctas_per_sm: int  # decode CTAs an SM runs at once: enough to stream, at most what it holds
    shared_bytes: int  # the decode launch's dynamic shared memory: no more CTAs than ctas_per_sm a SM


def decode_kernels(capability: tuple[int, int], device: int, head_dim: int, rows: int, paged: bool,
                   causal: bool, bf16: bool, *, window: bool = False, softcap: bool = False,
                   wide: bool = False, sink: bool = False, batch_idx: bool = False,
                   leftpad: bool = False, rotary: int = 0, head_dim_v: int = 0,
                   latent: bool = False, page_size: int = 0) -> DecodeKernels:
    """The config and the two loaded kernels of this problem on the current device: the attention
    kernel (``window``, ``softcap``: a variant) and the combine kernel, their specs
    (``kernels.spec``) built here once per new problem. ``wide``: the call's CTAs before any split
    outnumber the SMs (``configs.decode_config``). ``sink``: the learnable sink's build of the
    attention kernel (the combine kernel is the same); ``batch_idx``, ``leftpad``, ``rotary``: the
    builds of ``cache_batch_idx``, ``cache_leftpad`` and the rotary embedding (``KernelSpec``'s
    axes of those names); ``head_dim_v``: V's head dim where it differs (``configs.decode_config``).
    ``latent``: MLA decode (V is K's first head_dim_v columns: ``configs.mla_decode_config``, whose
    config depends on the 16, 32 or 64 rows). ``page_size``: a paged cache's page size where its
    tiles may be looked up whole (no cache_leftpad), else 0 (``configs.decode_config``)."""
    gpu = gpu_state.GPU
    row_kind = min(-(-rows // 16), 4) if latent else rows > 16
    short_key = ("decode", capability, device, head_dim, row_kind, paged, causal, bf16, window, softcap, wide,
                 sink, batch_idx, leftpad, rotary, head_dim_v, latent, page_size)
    ready = gpu.launchers.get(short_key)
    if ready is not None and not configs.DECODE_FORCED:
        return ready
    if latent:
        config = configs.mla_decode_config(capability, rows, paged, gpu.shared_limit(device))
    else:
        config = configs.decode_config(capability, head_dim, rows, paged, gpu.shared_limit(device), wide,
                                       head_dim_v, page_size)
        if config.paged != paged or (config.page_tiles and (page_size == 0 or page_size % config.block_n)):
            raise ValueError(f"decode config {config} cannot read this cache (paged: {paged}, page size "
                             f"{page_size or 'unaligned or none'}): page_tiles needs pages of a multiple of "
                             f"block_n rows and no cache_leftpad")
    main = kernel_spec(family_of(config).name, "decode", config, "bfloat16" if bf16 else "float16",
                       arch_of(capability), causal=causal, window=window, softcap=softcap, sink=sink,
                       batch_idx=batch_idx, leftpad=leftpad, rotary=rotary)
    key = ("decode", main, device)
    ready = gpu.launchers.get(key)
    if ready is None:
        from ..runtime.launch import KernelLauncher, kernel_registers, set_dynamic_shared_limit

        with gpu.lock:
            ready = gpu.launchers.get(key)
            if ready is None:
                parts = []
                ctas_per_sm, shared_bytes = 1, config.shared_bytes
                for spec in (main, main.sibling("decode_combine")):
                    kernel, name = loaded_kernel(spec)
                    if spec is main:
                        limit = gpu.shared_limit(device)
                        resident = resident_ctas(config.threads, kernel_registers(kernel.handle, device),
                                                 config.shared_bytes, limit)
                        ctas_per_sm = streaming_ctas(config.bytes_in_flight, resident,
                                                     gpu.memory_bandwidth(device) / gpu.sm_count(device))
                        if ctas_per_sm < resident:  # hold the SM to the CTAs that stream best
                            shared_bytes = occupancy_shared(config.shared_bytes, ctas_per_sm, limit)
                        set_dynamic_shared_limit(kernel.handle, device, shared_bytes)
                    programmatic = capability >= (9, 0)  # see ptx/grid.cu
                    launcher = KernelLauncher(kernel, kernel_abi(spec), name, programmatic)
                    parts.append((launcher, prepare_launch(spec)(config)))
                ready = gpu.launchers[key] = DecodeKernels(config, *parts, ctas_per_sm, shared_bytes)
    if not configs.DECODE_FORCED:  # the problem's own config: found by the shapes next time
        gpu.launchers[short_key] = ready
    return ready


class DecodePlan(NamedTuple):
    """What a validated decode call of one layout needs at launch, worked out once: the bound
    launches (``fire(stream, q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
    out, lse, o_part, lse_part)``, and with more than one split ``combine(stream, o_part,
    lse_part, out, lse)``), the output's and the LSE's shapes, the split scratch (float32
    elements, 0 with one split; lse_part's byte offset in it), the scratch scalar (what a
    missing array points at), the extents in bytes of q, k_cache, v_cache, k_new and v_new (0
    when absent) that a given out must not overlap, and a given out's own extent (its layout is
    in the plan's key)."""

    fire: Callable[..., None]
    combine: Callable[..., None] | None
    shape: tuple[int, int, int, int]
    lse_shape: tuple[int, int, int] | None
    parts: int
    lse_part_at: int
    scratch: int
    spans: tuple[int, int, int, int, int]
    out_span: int


def _layout(op: Operand | None) -> tuple | None:
    return None if op is None else (op.shape, op.strides)


def plan_key(device: int, dtype_name: str, causal: bool, scale_key: float | None, num_splits: int,
             return_lse: bool, ops: tuple, window_size: tuple[int, int] = (-1, -1),
             softcap: float = 0.0, sink: bool = False, options: tuple = (), latent: bool = False) -> tuple:
    """The key of a decode plan in ``GPU.plans``: the device, the dtype, the flags, the scale as
    the caller gave it (None or a float), the split request, the window (a tuple of two ints) and
    the softcap (a float) as validated, and (shape, strides) of q, k_cache, v_cache,
    cache_seqlens, k_new, v_new, block_table and out (None where absent); ``run_torch`` builds
    the same key from torch's metadata. A call with a learnable sink (``sink``) or cache options
    (``options``: (name, (shape, strides)) of cache_batch_idx and cache_leftpad where given, then
    the rotary embedding's entry; ``run_torch`` appends them the same way) has a longer key; an
    MLA call (``latent``) is keyed apart ("mla" in place of "decode")."""
    key = ("mla" if latent else "decode", device, dtype_name, causal, scale_key, num_splits, return_lse,
           window_size, softcap, *map(_layout, ops))
    key = (*key, "sink") if sink else key
    return (*key, *options) if options else key


def device_plan(qd: Operand, kcd: Operand, vcd: Operand, knd: Operand | None, vnd: Operand | None,
                seqd: Operand, btd: Operand | None, outd: Operand | None, causal: bool, scale: float,
                scale_key: float | None, num_splits: int, return_lse: bool, capability: tuple[int, int],
                device: int, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                sd: Operand | None = None, bid: Operand | None = None,
                lpd: Operand | None = None, rot: RotaryCall | None = None,
                latent: bool = False) -> DecodePlan:
    """The plan of a validated call: from ``GPU.plans``, else made (variant, config, kernels,
    split count, bound launches) and kept there unless a config is forced. With a window whose
    left side is bounded, the split count is chosen for the keys a row block's windows reach
    (``DecodeVariant.window_keys``, plus a tile for their alignment) instead of the cache's room.
    ``sd``: a learnable sink (float32 (heads_q,)): the sink build, whose fire takes its pointer
    after the plain ones; ``bid``, ``lpd``: cache_batch_idx, cache_leftpad (int32 (batch,)), and
    ``rot`` a rotary embedding: their builds, whose fire takes their pointers last (the rotary
    tables' cos then sin). ``latent``: MLA decode (``vcd`` is the first columns of ``kcd``, one KV
    head; ``entry.direct_flash_mla_with_kvcache``)."""
    gpu = gpu_state.GPU
    forced = bool(configs.DECODE_FORCED)
    key = plan_key(device, qd.dtype_name, causal, scale_key, num_splits, return_lse,
                   (qd, kcd, vcd, seqd, knd, vnd, btd, outd), window_size, softcap, sd is not None,
                   tuple((op.name, _layout(op)) for op in (bid, lpd) if op is not None)
                   + (() if rot is None else (("rotary", _layout(rot.cos), _layout(rot.sin), rot.kind,
                                               rot.q_step),)), latent)
    plan = None if forced else gpu.plans.get(key)
    if plan is not None:
        return plan
    batch, seqlen_q, heads_q, head_dim = qd.shape
    value_dim = vcd.shape[3]  # out's too
    heads_kv = kcd.shape[2]
    rows = heads_q // heads_kv * seqlen_q
    paged = btd is not None
    seqlen_new = knd.shape[1] if knd is not None else 0
    pages, capacity = (btd.shape[1], kcd.shape[1]) if paged else (0, kcd.shape[1])
    max_keys = (pages * capacity if paged else capacity) + seqlen_new
    var = decode_variant(causal, window_size, softcap, scale, seqlen_q, max_keys)
    bf16 = qd.dtype_name == "bfloat16"
    wide = batch * heads_kv * -(-rows // 16) > gpu.sm_count(device)  # 16-row blocks: the grid, unsplit
    kernels = decode_kernels(capability, device, head_dim, rows, paged, var.causal, bf16, window=var.window,
                             softcap=var.softcap, wide=wide, sink=sd is not None, batch_idx=bid is not None,
                             leftpad=lpd is not None, rotary=0 if rot is None else rot.kind,
                             head_dim_v=0 if value_dim == head_dim else value_dim, latent=latent,
                             page_size=capacity if paged and lpd is None and not latent else 0)
    config = kernels.config
    row_blocks = -(-rows // config.rows)
    if var.window_keys is not None:
        max_keys = min(max_keys, var.window_keys + config.block_n)
    splits = num_splits or decode_splits(batch, heads_kv, row_blocks, max_keys, config.block_n,
                                         gpu.sm_count(device), kernels.ctas_per_sm)
    scratch = gpu.scratch_f32(device)[0]
    lse_count = batch * heads_q * seqlen_q if return_lse else 1
    n = batch * heads_q * seqlen_q * splits if splits > 1 else 0
    out_shape = (batch, seqlen_q, heads_q, value_dim)
    out = outd or Operand("out", out_shape, qd.dtype_name, True, None,
                          (seqlen_q * heads_q * value_dim, heads_q * value_dim, value_dim, 1), 0)
    call = DecodeCall(qd, kcd, vcd, knd, vnd, paged, btd.strides[0] if paged else 0, pages, capacity,
                      out, lse_count, max(n * value_dim, 1), max(n, 1), splits, row_blocks,
                      var.scale_log2, return_lse, kernels.shared_bytes, var.window_left, var.window_right,
                      var.cap_scale, None if sd is None else (sd.pointer, heads_q), bid is not None,
                      lpd is not None, None if rot is None else (rot.dim, rot.cos.shape[0], rot.q_step))
    (decode_launcher, bind_decode), (combine_launcher, bind_combine) = kernels.decode, kernels.combine
    spans = tuple(2 * op.span if op is not None else 0 for op in (qd, kcd, vcd, knd, vnd))
    plan = DecodePlan(bind_decode(decode_launcher, call, gpu), bind_combine(combine_launcher, call, gpu),
                      out_shape, (batch, heads_q, seqlen_q) if return_lse else None,
                      split_scratch_elements(n, value_dim),
                      4 * n * value_dim, scratch, spans, 2 * out.span)
    if not forced:
        with gpu.lock:
            if len(gpu.plans) >= PLANS_KEPT:
                del gpu.plans[next(iter(gpu.plans))]
            gpu.plans[key] = plan
    return plan


def run_device(qd: Operand, kcd: Operand, vcd: Operand, knd: Operand | None, vnd: Operand | None,
               seqd: Operand, btd: Operand | None, outd: Operand | None, causal: bool, scale: float,
               scale_key: float | None, num_splits: int, return_lse: bool, capability: tuple[int, int],
               device: int, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               sd: Operand | None = None, bid: Operand | None = None,
               lpd: Operand | None = None, rot: RotaryCall | None = None,
               latent: bool = False) -> tuple[Any, Any]:
    """Launch decode (and combine) on the inputs' stream; returns (out, lse or None). ``sd``: a
    learnable sink, float32 (heads_q,); ``bid``, ``lpd``: cache_batch_idx, cache_leftpad, int32
    (batch,); ``rot``: a rotary embedding; ``latent``: MLA decode (``device_plan``)."""
    plan = device_plan(qd, kcd, vcd, knd, vnd, seqd, btd, outd, causal, scale, scale_key, num_splits,
                       return_lse, capability, device, window_size, softcap, sd, bid, lpd, rot, latent)
    if outd is None:
        out = empty_like(qd.obj, plan.shape, qd.dtype_name)
        out_pointer = device_pointer(out)
    else:
        out, out_pointer = outd.obj, outd.pointer
    lse = empty_lse(qd.obj, plan.lse_shape) if return_lse else None
    lse_pointer = device_pointer(lse) if return_lse else plan.scratch
    o_part = lse_part = plan.scratch
    if plan.parts:
        part = empty_lse(qd.obj, (plan.parts,))
        o_part = device_pointer(part)
        lse_part = o_part + plan.lse_part_at
    none = plan.scratch
    stream = stream_handle(qd)
    plan.fire(stream, qd.pointer, kcd.pointer, vcd.pointer, knd.pointer if knd else none,
              vnd.pointer if vnd else none, seqd.pointer, btd.pointer if btd else none, out_pointer,
              lse_pointer, o_part, lse_part, *(op.pointer for op in (sd, bid, lpd) if op is not None),
              *(() if rot is None else (rot.cos.pointer, rot.sin.pointer)))
    if plan.combine is not None:
        plan.combine(stream, o_part, lse_part, out_pointer, lse_pointer)
    return out, lse


_INT32: list = []  # [torch.int32], once a torch call has come here


def _torch_rotary(q: Any, k_cache: Any, block_table: Any, cos: Any, sin: Any, interleaved: Any, causal: bool,
                  window_size: tuple[int, int], device: int) -> tuple | None:
    """The rotary embedding of a torch call as ``device_plan`` keys it (("rotary", cos's and sin's
    layouts, the kind, the query rows' position step)) and the two tables' pointers, or None
    where the fast path cannot take it (a table missing, of another type, dtype or device, not on
    a 16-byte boundary; ``rotary_interleaved`` not a bool): the full checks then run."""
    types = TORCH_TYPES
    if (cos is None or sin is None or type(cos) not in types or type(sin) not in types
            or (interleaved is not True and interleaved is not False) or cos.dtype is not q.dtype
            or sin.dtype is not q.dtype or cos.get_device() != device or sin.get_device() != device):
        return None
    cos_pointer, sin_pointer = cos.data_ptr(), sin.data_ptr()
    if (cos_pointer | sin_pointer) & 15:
        return None
    room = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    entry = ("rotary", (cos.shape, cos.stride()), (sin.shape, sin.stride()), 2 if interleaved else 1,
             rotary_q_step(causal, window_size, room))
    return entry, cos_pointer, sin_pointer


def run_torch(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, k_new: Any, v_new: Any,
              block_table: Any, causal: Any, softmax_scale: Any, num_splits: Any, return_lse: Any, out: Any,
              window_size: Any = (-1, -1), softcap: Any = 0.0, learnable_sink: Any = None,
              cache_batch_idx: Any = None, cache_leftpad: Any = None, rotary_cos: Any = None,
              rotary_sin: Any = None, rotary_interleaved: Any = False, latent: bool = False):
    """Decode on torch tensors whose layout was validated before (a plan in ``GPU.plans``): the
    per-call checks (CUDA tensors of the right dtypes on the current device, aligned pointers,
    a given out overlapping no input; a learnable sink, cache_batch_idx and cache_leftpad
    contiguous vectors of their dtype, ``torch_small_pointer``; rotary tables of q's dtype, their
    layout in the key), the allocations and the fires. None where it cannot tell that the call is
    good: the full path (``entry.direct_flash_attention_with_kvcache``) then runs and gives the
    errors. A window or softcap of another type than the validated ones (a tuple of two ints, a
    float), or a rotary_interleaved that is not a bool, takes the full path too. ``latent``: an MLA
    call (``entry.direct_flash_mla_with_kvcache``, ``v_cache`` the latent cache itself): V's layout is
    its first ``configs.MLA_HEAD_DIMS[1]`` columns, the plan's key is MLA's."""
    gpu = gpu_state.GPU
    plans = gpu.plans
    if (not plans or configs.DECODE_FORCED or (causal is not True and causal is not False)
            or (return_lse is not True and return_lse is not False) or type(num_splits) is not int
            or not 0 <= num_splits <= MAX_SPLITS
            or (softmax_scale is not None and type(softmax_scale) is not float)
            or type(softcap) is not float or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    types = TORCH_TYPES
    if (type(q) not in types or type(k_cache) not in types or type(v_cache) not in types
            or type(cache_seqlens) not in types):
        return None
    if not _INT32:
        import torch

        _INT32.append(torch.int32)
    dtype = q.dtype
    name = TORCH_DTYPE_NAMES.get(dtype)
    device = q.get_device()
    if (name is None or k_cache.dtype is not dtype or v_cache.dtype is not dtype or device < 0
            or k_cache.get_device() != device or v_cache.get_device() != device
            or cache_seqlens.dtype is not _INT32[0] or cache_seqlens.get_device() != device):
        return None
    v_layout = (((*k_cache.shape[:3], configs.MLA_HEAD_DIMS[1]), k_cache.stride()) if latent
                else (v_cache.shape, v_cache.stride()))
    layouts = [(q.shape, q.stride()), (k_cache.shape, k_cache.stride()), v_layout,
               (cache_seqlens.shape, cache_seqlens.stride())]
    pointers = [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()]
    for x in (k_new, v_new):
        if x is None:
            layouts.append(None)
            continue
        if type(x) not in types or x.dtype is not dtype or x.get_device() != device:
            return None
        layouts.append((x.shape, x.stride()))
        pointers.append(x.data_ptr())
    if block_table is None:
        layouts.append(None)
    else:
        if (type(block_table) not in types or block_table.dtype is not _INT32[0]
                or block_table.get_device() != device):
            return None
        layouts.append((block_table.shape, block_table.stride()))
    if out is not None:
        if type(out) not in types or out.dtype is not dtype or out.get_device() != device:
            return None
        layouts.append((out.shape, out.stride()))
    else:
        layouts.append(None)
    key = ("mla" if latent else "decode", device, name, causal, softmax_scale, num_splits, return_lse,
           window_size, softcap, *layouts)  # plan_key's
    extra = []  # the options' pointers, in the fire's order: sink, cache_batch_idx, cache_leftpad
    if learnable_sink is not None:
        pointer = torch_small_pointer(learnable_sink, FLOAT32[0], q.shape[2], device)
        if pointer is None:
            return None
        key = (*key, "sink")
        extra.append(pointer)
    for option, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if x is not None:
            pointer = torch_small_pointer(x, _INT32[0], q.shape[0], device)
            if pointer is None:
                return None
            key = (*key, (option, (x.shape, x.stride())))
            extra.append(pointer)
    if rotary_cos is not None or rotary_sin is not None:
        tables = _torch_rotary(q, k_cache, block_table, rotary_cos, rotary_sin, rotary_interleaved, causal,
                               window_size, device)
        if tables is None:
            return None
        key = (*key, tables[0])
        extra += tables[1:]
    plan = plans.get(key)
    if plan is None or gpu.current()[1] != device:
        return None
    seq_pointer = cache_seqlens.data_ptr()
    table_pointer = block_table.data_ptr() if block_table is not None else plan.scratch
    aligned = 0
    for pointer in pointers:
        aligned |= pointer
    if aligned & 15 or (seq_pointer | table_pointer) & 3:
        return None
    if out is None:
        out = q.new_empty(plan.shape)
        out_pointer = out.data_ptr()
    else:
        out_pointer = out.data_ptr()
        end = out_pointer + plan.out_span
        if out_pointer & 15 or any(p < end and out_pointer < p + span
                                   for p, span in zip(pointers, plan.spans, strict=False)):
            return None
    lse = q.new_empty(plan.lse_shape, dtype=FLOAT32[0]) if return_lse else None
    lse_pointer = lse.data_ptr() if return_lse else plan.scratch
    o_part = lse_part = plan.scratch
    part = None
    if plan.parts:  # stream-ordered: torch reuses it only for work queued after these launches
        part = q.new_empty((2 * plan.parts,))  # the float32 scratch as 16-bit elements: no dtype keyword
        o_part = part.data_ptr()
        lse_part = o_part + plan.lse_part_at
    none = plan.scratch
    stream = torch_stream(device)
    k_new_pointer = pointers[3] if k_new is not None else none
    v_new_pointer = pointers[4] if v_new is not None else none
    plan.fire(stream, pointers[0], pointers[1], pointers[2], k_new_pointer, v_new_pointer, seq_pointer,
              table_pointer, out_pointer, lse_pointer, o_part, lse_part, *extra)
    if plan.combine is not None:
        plan.combine(stream, o_part, lse_part, out_pointer, lse_pointer)
    return (out, lse) if return_lse else out
