"""The forward operation: choose the config, load its kernel, launch it on device arrays, or
run the numpy pipeline (``runtime.pipeline``) over host arrays.

The hot path (device arrays of a layout seen before) is one dictionary lookup for the call's
plan (``GPU.plans``, keyed by device, dtype, flags, scale, shapes and strides: the launch bound
to everything but the memory and the stream), the per-call checks and one launch. On torch
tensors (``run_torch``) the key is read straight off the tensors. A new layout picks its launcher
from ``GPU.ready`` (keyed by device, head dim, causality, dtype and sequence span).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import configs
from ..kernels.families import family_of, kernel_abi
from ..kernels.spec import KernelSpec, kernel_spec
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
from . import launch_forward, warm
from .launch_forward import ForwardCall
from .launches import prepare_launch

LOG2_E = math.log2(math.e)
# What a window kernel gets for a side given as -1 (unbounded): larger than any distance between
# a query and a key, so that it bounds nothing (``kernels.blocks.Band``), and small enough that
# the kernel's int64 sums of it and a row index cannot overflow.
WINDOW_UNBOUNDED = 1 << 40


class Variant(NamedTuple):
    """Which forward kernel a call runs, and the arguments that depend on its window and softcap
    (``variant_of``): whether its kernel is a window and a softcap variant, the ``causal`` its
    config is chosen with (the window kernel itself is built non-causal: ``kernels.spec``), the
    window's sides as the kernel takes them
    (each >= 0; ``WINDOW_UNBOUNDED`` for -1; 0 when there is no window), the kernel's exponent
    factor (softmax_scale·log2(e), or with a softcap softcap·log2(e)) and softmax_scale / softcap
    (0 without), both float32, and whether every row's keys end at its causal diagonal (the
    window's right side is 0: the numpy pipeline then cuts each chunk's keys there)."""

    window: bool
    softcap: bool
    causal: bool
    window_left: int
    window_right: int
    scale_log2: np.float32
    cap_scale: np.float32
    rows_end_at_diagonal: bool


def effective_window(causal: bool, window_size: tuple[int, int], seqlen_q: int,
                     seqlen_k: int) -> tuple[int, int]:
    """The window a call masks with, FlashAttention's rule: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 meaning unbounded;
    ``causal`` sets right to 0. A side that bounds no row of this problem becomes -1 (left >=
    seqlen_k - 1: every row's lower edge is at or below key 0; right >= seqlen_q - 1: every row's
    upper edge is at or past the last key), so that a window as wide as the problem runs the plain
    or causal kernel. ``window_size`` (-1, -1) is returned as it is (causal: (-1, 0)), so calls
    without a window run what they always ran."""
    left, right = window_size
    if causal:
        right = 0
    if window_size == (-1, -1):
        return left, right
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    return left, right


def variant_of(causal: bool, window_size: tuple[int, int], softcap: float, softmax_scale: float,
               seqlen_q: int, seqlen_k: int) -> Variant:
    """The kernel of a validated call (``effective_window``): no window left (-1, -1): the plain
    kernel; (-1, 0): the causal one; any other: the window kernel (built once, as non-causal; its
    config is the causal one where the window's right side is bounded, a band like the causal
    triangle's edge); each with a softcap (> 0) or not."""
    left, right = effective_window(causal, window_size, seqlen_q, seqlen_k)
    window = (left, right) not in ((-1, -1), (-1, 0))
    capped = softcap > 0
    scale_log2 = np.float32((softcap if capped else softmax_scale) * LOG2_E)
    cap_scale = np.float32(softmax_scale / softcap if capped else 0.0)
    sides = (0, 0)
    if window:
        sides = (WINDOW_UNBOUNDED if left < 0 else left, WINDOW_UNBOUNDED if right < 0 else right)
    return Variant(window, capped, right != -1, *sides, scale_log2, cap_scale, right == 0)



def keys_past_diagonal(var: Variant) -> int:
    """Where a row's keys end for the numpy pipeline (``pipeline.Problem.past_diagonal``): 0
    with causal masking or a window's right side 0, the right side of any other bounded window,
    else -1 (at the last key)."""
    if var.rows_end_at_diagonal:
        return 0
    return var.window_right if var.window and var.window_right < WINDOW_UNBOUNDED else -1


def chunk_window_sides(var: Variant, diag_shift: int) -> tuple[int, int]:
    """The window sides the kernel of one row chunk takes (``pipeline.diagonal_shift``): the
    chunk's diagonal lies ``diag_shift`` keys before its rows' own, so the band moves back by
    it, and each row sees the keys it sees in the whole problem. Both stay >= 0: a chunk's
    keys end at its last row's last key or at the last key (``pipeline.Chunk.rows``)."""
    if not var.window:
        return var.window_left, var.window_right
    return var.window_left - diag_shift, var.window_right + diag_shift


def ready_key(device: int, head_dim: int, causal: bool, bf16: bool, seqlen: int | None,
              window: bool = False, softcap: bool = False, varlen: bool = False, sink: bool = False,
              head_dim_v: int = 0) -> tuple:
    """The key of ``GPU.ready``, the launchers of unforced configs: what picks the config on a
    device (``configs.forward_config`` is memoised on the same inputs), and the kernel's variant
    (``Variant.window``, ``Variant.softcap``; packed sequences: ``varlen``; a learnable sink:
    ``sink``, a key of one more element; V's head dim where it differs, ``head_dim_v``, one more)."""
    key = device, head_dim, causal, bf16, configs.seqlen_span(seqlen), window, softcap, varlen
    key = (*key, True) if sink else key
    return (*key, "v", head_dim_v) if head_dim_v else key


def forward_kernel(capability: tuple[int, int], device: int, head_dim: int, causal: bool, bf16: bool,
                   seqlen: int | None = None, *, window: bool = False, softcap: bool = False,
                   varlen: bool = False, sink: bool = False, head_dim_v: int = 0):
    """(launcher, config, launch) for this problem on the current device (ordinal ``device``).

    The config is the table's for this GPU, passing over entries that need more shared memory
    than the device gives a CTA (``configs.forward_config``), and taking its short- or
    long-sequence entry by ``seqlen`` (the longer of seqlen_q and seqlen_k).
    The cubin comes from the on-disk kernel cache (``runtime.cache``) or is compiled and stored
    there; it is loaded once per process, and its shared-memory limit is raised once per device.
    ``window``, ``softcap``: a variant (``Variant``); ``varlen``: a packed variable-length kernel;
    ``sink``: a learnable sink's build of the same config (``KernelSpec.sink``); ``head_dim_v``:
    V's head dim where it differs from ``head_dim`` (``configs.ASYMMETRIC_HEAD_DIMS``); where the
    GPU's own family lacks it, the sm80 family's config and kernel run
    (``configs.dispatch_family``). The kernel's spec (``kernels.spec``) is built here, once per
    new problem, and keys the loaded kernels.
    """
    gpu = gpu_state.GPU
    limit = gpu.shared_limit(device)
    config = configs.forward_config(capability, head_dim, causal, limit, seqlen, window=window, varlen=varlen,
                                    head_dim_v=head_dim_v)
    spec = kernel_spec(family_of(config).name, "forward", config, "bfloat16" if bf16 else "float16",
                       arch_of(capability), causal=causal, window=window, softcap=softcap, varlen=varlen,
                       sink=sink)
    key = (spec, device)
    ready = gpu.launchers.get(key)
    if ready is None:
        if config.shared_bytes > limit:  # only a forced config gets here (force_config)
            raise RuntimeError(f"{config} needs {config.shared_bytes} bytes of shared memory a CTA; device "
                               f"{device} (sm_{capability[0]}{capability[1]}) allows {limit}")
        from ..runtime.launch import KernelLauncher, set_dynamic_shared_limit

        with gpu.lock:
            ready = gpu.launchers.get(key)
            if ready is None:
                kernel, name = loaded_kernel(spec)
                set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
                ready = (KernelLauncher(kernel, kernel_abi(spec), name), config, prepare_launch(spec)(config))
                gpu.launchers[key] = ready
    if not configs.OVERRIDES:  # the hot path's table (run_device) holds unforced configs only
        gpu.ready[ready_key(device, head_dim, causal, bf16, seqlen, window, softcap, varlen, sink,
                            head_dim_v)] = ready
    return ready


def loaded_kernel(spec: KernelSpec):
    """(cuda.core Kernel, entry name) of ``spec``'s kernel, loaded once per process (the loaded
    library serves every device; call with ``GPU.lock`` held)."""
    modules = gpu_state.GPU.modules
    if spec not in modules:
        from cuda.core import ObjectCode

        entry = warm.entry_of(spec)  # a kernel compiling in a worker process is waited for
        kernel = ObjectCode.from_cubin(entry.cubin).get_kernel(entry.entry_name)
        modules[spec] = (kernel, entry.entry_name)
    return modules[spec]


class DevicePlan(NamedTuple):
    """What a validated device call of one layout (``plan_key``) needs at launch, worked out
    once: ``fire(stream, q, k, v, o, lse)`` (device pointers; ``ForwardLaunch.bind``; a sink
    call's ``fire(stream, q, k, v, o, lse, sink)``), the device,
    the output's shape, the LSE's shape when it is returned (else ``lse``: the scratch pointer
    the kernel gets), and what the per-call checks of a given ``out`` read: the extents of q, k,
    v and out in bytes, and whether out has q's strides (then it may be q itself)."""

    fire: Callable[..., None]
    device: int
    shape: tuple[int, int, int, int]
    lse_shape: tuple[int, int, int] | None
    lse: int
    spans: tuple[int, int, int, int]
    out_strides_are_q: bool


# Plans kept per process (the oldest go first): a decode loop whose key length grows makes a new
# layout at each step, and the layers of one step share it.
PLANS_KEPT = 1024


def plan_key(device: int, dtype_name: str, causal: bool, scale_key: float | None, return_lse: bool,
             qd: Operand, kd: Operand, vd: Operand, od: Operand | None,
             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sink: bool = False) -> tuple:
    """The key of ``GPU.plans``: the device, the dtype, the flags, the scale as the caller gave
    it (None or a float; ``run_torch`` builds the same key from torch's metadata), the window (a
    tuple of two ints) and the softcap (a float) as validated, and the shapes and strides of q,
    k, v and a given out; a call with a learnable sink (``sink``) has a key of one more element
    (``run_torch`` appends it the same way)."""
    if od is None:
        key = (device, dtype_name, causal, scale_key, return_lse, window_size, softcap, qd.shape, qd.strides,
               kd.shape, kd.strides, vd.shape, vd.strides)
    else:
        key = (device, dtype_name, causal, scale_key, return_lse, window_size, softcap, qd.shape, qd.strides,
               kd.shape, kd.strides, vd.shape, vd.strides, od.shape, od.strides)
    return (*key, "sink") if sink else key


def device_plan(qd: Operand, kd: Operand, vd: Operand, od: Operand | None, causal: bool, scale: float,
                scale_key: float | None, return_lse: bool, capability, device: int,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                sd: Operand | None = None) -> DevicePlan:
    """The plan of a validated device call: from ``GPU.plans``, else made (the config picked, its
    kernel loaded, the launch bound) and kept there unless a config is forced. ``sd``: a learnable
    sink (float32 (heads_q,)): the sink build of the same config."""
    gpu = gpu_state.GPU
    forced = bool(configs.OVERRIDES) or launch_forward.FOLD_GRID
    sink = sd is not None
    key = plan_key(device, qd.dtype_name, causal, scale_key, return_lse, qd, kd, vd, od, window_size, softcap,
                   sink)
    plan = None if forced else gpu.plans.get(key)
    if plan is not None:
        return plan
    batch, seqlen_q, heads_q, head_dim = qd.shape
    seqlen_k = kd.shape[1]
    head_dim_v = 0 if vd.shape[3] == head_dim else vd.shape[3]
    out_shape = (batch, seqlen_q, heads_q, vd.shape[3])
    bf16 = qd.dtype_name == "bfloat16"
    longest = seqlen_q if seqlen_q > seqlen_k else seqlen_k
    var = variant_of(causal, window_size, softcap, scale, seqlen_q, seqlen_k)
    causal = var.causal  # the kernel's (its config's) causal flag
    ready = None if forced else gpu.ready.get(ready_key(device, head_dim, causal, bf16, longest,
                                                        var.window, var.softcap, False, sink, head_dim_v))
    launcher, config, launch = ready or forward_kernel(capability, device, head_dim, causal, bf16, longest,
                                                       window=var.window, softcap=var.softcap, sink=sink,
                                                       head_dim_v=head_dim_v)
    lse_shape = (batch, heads_q, seqlen_q)
    lse = (0, batch * heads_q * seqlen_q) if return_lse else gpu.scratch_f32(device)
    o = od or Operand("out", out_shape, qd.dtype_name, True, None, _dense(out_shape), 0)
    call = ForwardCall(qd, kd, vd, o, lse, seqlen_k, kd.shape[2], var.scale_log2, return_lse, 0, device,
                       var.window_left, var.window_right, var.cap_scale,
                       None if sd is None else (sd.pointer, heads_q))
    plan = DevicePlan(launch.bind(launcher, call, gpu), device, out_shape, lse_shape if return_lse else None,
                      lse[0], (2 * qd.span, 2 * kd.span, 2 * vd.span, 2 * o.span),
                      o.strides == qd.strides and o.shape == qd.shape)
    if not forced:
        with gpu.lock:
            if len(gpu.plans) >= PLANS_KEPT:
                del gpu.plans[next(iter(gpu.plans))]
            gpu.plans[key] = plan
    return plan


def run_device(q: Any, qd: Operand, kd: Operand, vd: Operand, od: Operand | None, out: Any,
               causal: bool, scale: float, scale_key: float | None, return_lse: bool, capability,
               device: int, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               sd: Operand | None = None):
    """The forward on validated device arrays: one launch on the inputs' stream (``sd``: a
    learnable sink, float32 (heads_q,))."""
    plan = device_plan(qd, kd, vd, od, causal, scale, scale_key, return_lse, capability, device, window_size,
                       softcap, sd)
    sink = () if sd is None else (sd.pointer,)
    if out is None:
        out = empty_like(q, plan.shape, qd.dtype_name)
        o = device_pointer(out)
    else:
        o = od.pointer
    if return_lse:
        lse_obj = empty_lse(q, plan.lse_shape)
        lse = device_pointer(lse_obj)
    else:
        lse_obj, lse = None, plan.lse
    plan.fire(stream_handle(qd), qd.pointer, kd.pointer, vd.pointer, o, lse, *sink)
    return (out, lse_obj) if return_lse else out


def run_torch(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, return_lse: Any, out: Any,
              window_size: Any = (-1, -1), softcap: Any = 0.0, learnable_sink: Any = None):
    """The forward on torch tensors whose layout was validated before (a plan in ``GPU.plans``):
    the per-call checks (CUDA tensors of one dtype on the current device, 16-byte aligned
    pointers, a given out overlapping k and v nowhere and q only as q itself; a learnable sink
    float32 (heads_q,), contiguous, ``torch_small_pointer``), one allocation and one launch.
    None where it cannot tell that the call is good: the full path
    (``entry.direct_flash_attention``) then runs and gives the errors. A window or softcap of
    another type than the validated ones (a tuple of two ints, a float) takes the full path too."""
    gpu = gpu_state.GPU
    plans = gpu.plans
    if (not plans or configs.OVERRIDES or launch_forward.FOLD_GRID
            or (causal is not True and causal is not False)
            or (return_lse is not True and return_lse is not False)
            or (softmax_scale is not None and type(softmax_scale) is not float)
            or type(softcap) is not float or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    types = TORCH_TYPES
    if type(k) not in types or type(v) not in types or not (q.is_cuda and k.is_cuda and v.is_cuda):
        return None
    dtype = q.dtype
    name = TORCH_DTYPE_NAMES.get(dtype)
    device = q.get_device()
    if (name is None or k.dtype is not dtype or v.dtype is not dtype or k.get_device() != device
            or v.get_device() != device):
        return None
    key = (device, name, causal, softmax_scale, return_lse, window_size, softcap, q.shape, q.stride(),
           k.shape, k.stride(), v.shape, v.stride())  # plan_key's
    if out is not None:
        if not (type(out) in types and out.is_cuda and out.dtype is dtype and out.get_device() == device):
            return None
        key = (*key, out.shape, out.stride())
    sink = ()
    if learnable_sink is not None:
        pointer = torch_small_pointer(learnable_sink, FLOAT32[0], q.shape[2], device)
        if pointer is None:
            return None
        key, sink = (*key, "sink"), (pointer,)
    plan = plans.get(key)
    if plan is None or gpu.current()[1] != device:
        return None
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if out is None:
        if (qp | kp | vp) & 15:
            return None
        out = q.new_empty(plan.shape)
        op = out.data_ptr()
    else:
        op = out.data_ptr()
        if (qp | kp | vp | op) & 15:
            return None
        q_span, k_span, v_span, o_span = plan.spans
        o_end = op + o_span
        if ((kp < o_end and op < kp + k_span) or (vp < o_end and op < vp + v_span)
                or (qp < o_end and op < qp + q_span and not (qp == op and plan.out_strides_are_q))):
            return None
    if return_lse:
        lse_obj = q.new_empty(plan.lse_shape, dtype=FLOAT32[0])
        plan.fire(torch_stream(device), qp, kp, vp, op, lse_obj.data_ptr(), *sink)
        return out, lse_obj
    plan.fire(torch_stream(device), qp, kp, vp, op, plan.lse, *sink)
    return out


def _dense(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Element strides of a C-contiguous 4-D array of ``shape``."""
    _, s, h, d = shape
    return s * h * d, h * d, d, 1


def run_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray | None, dtype_name: str,
              causal: bool, scale: float, return_lse: bool, capability, device: int,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0):
    """The forward on numpy arrays: the chunked pipeline over pinned staging buffers and several
    streams. Results go to pooled pinned memory (the copy engines write them in place), or
    straight into ``out`` unless it shares memory with an input (then via a copy).

    A chunk of query rows r0 .. r1 - 1 is a problem of its own whose keys end where its last
    row's keys do (causal, or a window: ``keys_past_diagonal``); its kernel puts the diagonal
    where that chunk's seqlen_k - seqlen_q says, so a window kernel takes the sides that keep
    every row's band in place (``chunk_window_sides``)."""
    from ..runtime.pipeline import pinned_empty, run_numpy_forward

    batch, seqlen_q, heads_q, head_dim = q.shape
    var = variant_of(causal, window_size, softcap, scale, seqlen_q, k.shape[1])
    bf16 = dtype_name == "bfloat16"
    head_dim_v = 0 if v.shape[3] == head_dim else v.shape[3]
    launcher, config, launch = forward_kernel(capability, device, head_dim, var.causal, bf16,
                                              max(seqlen_q, k.shape[1]), window=var.window,
                                              softcap=var.softcap, head_dim_v=head_dim_v)
    scale_log2 = var.scale_log2
    direct = out is not None and not any(np.may_share_memory(out, x) for x in (q, k, v))
    result = out if direct else pinned_empty((*q.shape[:3], v.shape[3]), q.dtype)
    lse_host = pinned_empty((batch, heads_q, seqlen_q), np.float32) if return_lse else None

    def launch_chunk(lay, base: int, sub, stream: int) -> None:
        """The kernel on one chunk, whose q, k, v, o (and LSE) sit dense from ``base``."""
        def dense(name, shape, offset):
            return Operand(name, shape, dtype_name, True, None, _dense(shape), base + offset)

        lse_arg = ((base + lay.lse, math.prod(lay.lse_shape)) if return_lse
                   else gpu_state.GPU.scratch_f32(device))
        left, right = chunk_window_sides(var, sub.diag_shift)
        call = ForwardCall(dense("q", lay.q_shape, lay.q), dense("k", lay.kv_shape, lay.k),
                           dense("v", lay.v_shape, lay.v), dense("out", lay.o_shape, lay.o), lse_arg,
                           sub.seqlen_k, sub.heads_kv, scale_log2, return_lse, stream, device,
                           left, right, var.cap_scale)
        launch(launcher, call, gpu_state.GPU)

    run_numpy_forward(device, q, k, v, result, lse_host, launch_chunk, keys_past_diagonal(var),
                      config.block_m)
    if out is not None and not direct:
        out[...] = result
        result = out
    return (result, lse_host) if return_lse else result
