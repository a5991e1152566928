"""The backward operation: choose the config, load its three kernels (prepare, main, dQ), and
launch them on device arrays, or stage numpy arrays through page-locked memory and run them.

The device path runs a plan (``BackwardPlan`` in ``GPU.plans``, keyed by device, dtype, flags,
scale, window, softcap, and the shapes and strides of every operand: the three launches bound to
everything but the memory and the stream, ``launch_backward.Launch.bind``), made once per layout
from the launchers (``GPU.launchers``, keyed by device, head dim, causality, dtype and the main
kernel's variant); then a call is the gradients' and the workspace's allocations of the inputs'
library and the plan's fire on the inputs' stream. On torch tensors (``run_torch``) the key is
read straight off the tensors, and only what may change between calls of one layout is checked.

A sliding window or a softcap (issue 35) runs a variant of the main kernel (``backward_variant``:
the forward's ``variant_of``, so that both passes agree on the window a call masks with and on the
kernel arguments); the config is the one the same call without them would choose (causal where
the window's right side is bounded, as the forward's).

A learnable sink (issue 56, device arrays only) runs the prepare kernel's sink build, which adds
d_sink = -Σ p_sink · D into a zeroed float32 (heads_q,) array (``zeroed_sink_gradient``); the
main and dQ kernels are the plain ones: with the forward's sink-inclusive LSE their P is already
the sink softmax's, and D = rowsum(dO ∘ O) is unchanged (the sink has no value row).

Where the Hopper backward's grid is small (``call_group_splits`` > 1: GQA, not deterministic,
fewer than two waves of CTAs) the call runs the main kernel's GQA-split build
(``KernelSpec.group_split``, a kernel of its own, compiled on demand or by ``precompile``); every
other call runs the build without split code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import configs
from ..kernels.families import BACKWARD_OPERATIONS, family_of, kernel_abi
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
from ..runtime.cache import describe
from ..runtime.compiler import arch_of
from . import forward, warm
from .forward import Variant, loaded_kernel, variant_of
from .launch_backward import BackwardCall, Launch, WorkspaceLayout, backward_group_splits, workspace_layout
from .launches import prepare_launch

# driver calls of the numpy path, failures named for this operation
_call = functools.partial(gpu_state.driver_call, operation="backward")

LOG2_E = math.log2(math.e)


class BackwardKernels(NamedTuple):
    """One config's three kernels on one device, each as (``KernelLauncher``, launch function),
    in launch order."""

    config: Any  # kernels.shapes.BackwardConfig, or WsBackwardConfig (the Hopper backward)
    prep: tuple[Any, Launch]
    main: tuple[Any, Launch]
    dq: tuple[Any, Launch]


def ready_key(device: int, head_dim: int, causal: bool, bf16: bool, window: bool = False,
              softcap: bool = False, varlen: bool = False, sink: bool = False, head_dim_v: int = 0,
              group_split: bool = False, long: bool = False) -> tuple:
    """The key in ``GPU.launchers`` of the kernels an unforced call runs: what picks the config on
    a device (``configs.backward_config`` is memoised on the same inputs), the main kernel's
    variant (``Variant.window``, ``Variant.softcap``, packed sequences, the GQA split) and whether
    the prepare kernel is the learnable sink's build (V's head dim where it differs, the GQA
    split and a long query sequence, ``configs.backward_is_long``: one element more each)."""
    key = "backward", device, head_dim, causal, bf16, window, softcap, varlen, sink
    key = (*key, head_dim_v) if head_dim_v else key
    key = (*key, "group_split") if group_split else key
    return (*key, "long") if long else key


def backward_variant(causal: bool, window_size: tuple[int, int], softcap: float, scale: float,
                     seqlen_q: int, seqlen_k: int) -> Variant:
    """The forward's ``Variant`` of a validated call (``forward.variant_of``: the effective window,
    the config's causal flag, the window's sides and the softcap's factors as kernel arguments):
    its ``window`` and ``softcap`` pick the backward's main kernel too."""
    return variant_of(causal, window_size, softcap, scale, seqlen_q, seqlen_k)


def call_specs(main: KernelSpec, sink: bool = False) -> list[KernelSpec]:
    """The specs of one call's three kernels in launch order (``BACKWARD_OPERATIONS``), from its
    main kernel's: the siblings, the prepare kernel's the learnable sink's build where ``sink``
    (the main and dQ kernels have none: ``kernels.spec.SINK_FREE``)."""
    return [main.sibling(operation, sink=sink) for operation in BACKWARD_OPERATIONS]


def backward_kernels(capability: tuple[int, int], device: int, head_dim: int, causal: bool,
                     bf16: bool, *, window: bool = False, softcap: bool = False,
                     varlen: bool = False, sink: bool = False, head_dim_v: int = 0,
                     group_split: bool = False, long: bool = False) -> BackwardKernels:
    """The config and the three loaded kernels of this problem on the current device (ordinal
    ``device``).

    The config is the table's, else the first default that fits the device's shared memory a CTA
    (``configs.backward_config``, of the family ``configs.backward_dispatch_family`` picks: on
    Hopper at head dims 64 and 128 the warp-specialised backward, whose prepare and dQ kernels are
    the mma.sync ones of ``config.dq_config()``; it shares their workspace: its block_m rows a
    step, the dQ accumulator in ``dq_config()``'s fragment order). Each kernel's cubin comes
    from the on-disk kernel cache or is compiled for the device's own target (``arch_of``:
    ``sm_90a`` on Hopper, ``sm_86`` on an sm_86 GPU, as the sm80 forward) and stored; it is
    loaded once per process, and the main kernel's shared-memory limit is raised once per
    device. ``window``, ``softcap``: the main kernel's variant (``backward_variant``; compiled on
    demand); ``varlen``: the packed variable-length builds of all three kernels, with the same
    config; ``sink``: the prepare kernel's learnable-sink build (``call_specs``). Each kernel's
    spec (``kernels.spec``) is built here, once per new problem: the main kernel's, and its
    siblings' (``KernelSpec.sibling``: the prepare and dQ kernels, built without the mask and
    softcap they do not depend on). ``head_dim_v``: V's head dim where it differs
    (``configs.ASYMMETRIC_HEAD_DIMS``). ``group_split``: the main kernel's GQA-split build (a
    family with ``group_splits`` only: ``call_group_splits`` > 1). ``long``: the call's query
    sequence is long (``configs.backward_is_long``), which may pick another config.
    """
    gpu = gpu_state.GPU
    hot = ready_key(device, head_dim, causal, bf16, window, softcap, varlen, sink, head_dim_v, group_split,
                    long)
    if not configs.OVERRIDES:
        ready = gpu.launchers.get(hot)
        if ready is not None:
            return ready
    limit = gpu.shared_limit(device)
    config, main = backward_specs(capability, limit, head_dim, causal, bf16, window=window, softcap=softcap,
                                  varlen=varlen, head_dim_v=head_dim_v, group_split=group_split, long=long)
    key = ("backward", main, sink, device)
    ready = gpu.launchers.get(key)
    if ready is None:
        if config.shared_bytes > limit:  # only a forced config gets here (force_config)
            raise RuntimeError(f"{config} needs {config.shared_bytes} bytes of shared memory a CTA; device "
                               f"{device} (sm_{capability[0]}{capability[1]}) allows {limit}")
        from ..runtime.launch import KernelLauncher, set_dynamic_shared_limit

        with gpu.lock:
            ready = gpu.launchers.get(key)
            if ready is None:
                parts = []
                for spec in call_specs(main, sink):
                    kernel, name = loaded_kernel(spec)
                    if spec.operation == "backward":  # the main kernel
                        set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
                    launcher = KernelLauncher(kernel, kernel_abi(spec), name)
                    parts.append((launcher, prepare_launch(spec)(config)))
                ready = gpu.launchers[key] = BackwardKernels(config, *parts)
    if not configs.OVERRIDES:  # the hot path's entry holds unforced configs only
        gpu.launchers[hot] = ready
    return ready


def backward_specs(capability: tuple[int, int], limit: int | None, head_dim: int, causal: bool, bf16: bool, *,
                   window: bool = False, softcap: bool = False, varlen: bool = False, head_dim_v: int = 0,
                   group_split: bool = False, long: bool = False) -> tuple[Any, KernelSpec]:
    """(config, main kernel's spec) of a call on a GPU of ``capability`` giving a CTA ``limit`` bytes
    of shared memory (None: ``configs.max_shared_bytes``): ``configs.backward_config``'s config, the
    main kernel's spec for the GPU's own target; ``main.sibling(operation)`` for each of
    ``BACKWARD_OPERATIONS`` gives the call's three kernels.

    ``group_split``: the main kernel's GQA-split build (``KernelSpec.group_split``); ``long``: a
    long query sequence (``configs.backward_is_long``).

    Raises what ``configs.backward_config`` raises (a head dim with no backward, no config that fits)."""
    config = configs.backward_config(capability, head_dim, causal, limit, window=window, softcap=softcap,
                                     varlen=varlen, head_dim_v=head_dim_v, long=long)
    main = kernel_spec(family_of(config).name, "backward", config, "bfloat16" if bf16 else "float16",
                       arch_of(capability), causal=causal, window=window, softcap=softcap, varlen=varlen,
                       group_split=group_split)
    return config, main


# ready_key()s whose kernels were handed to the background compile (or found ready), so that a
# training loop's next forwards cost one lookup
_PREPARED: set = set()


def prepare_backward(capability: tuple[int, int], device: int, head_dim: int, causal: bool, bf16: bool, *,
                     window: bool = False, softcap: bool = False, varlen: bool = False,
                     sink: bool = False, head_dim_v: int = 0, long: bool = False) -> int:
    """Start compiling, in worker processes, the kernels the backward of this call will load
    (``backward_kernels``' three, by ``backward_specs``), where they are neither loaded nor cached
    (``operations.warm``; the backward waits on them there); returns how many. What the forward
    runs when a backward will follow (its inputs require grad), before it compiles its own kernel.
    Once per problem kind (``ready_key``) and device; nothing under a forced config, and nothing
    where the backward has no config (it raises then, with the message)."""
    key = ready_key(device, head_dim, causal, bf16, window, softcap, varlen, sink, head_dim_v, long=long)
    if key in _PREPARED or configs.OVERRIDES or not warm.enabled():
        return 0
    _PREPARED.add(key)
    gpu = gpu_state.GPU
    if key in gpu.launchers:
        return 0
    try:
        _, main = backward_specs(capability, gpu.shared_limit(device), head_dim, causal, bf16, window=window,
                                 softcap=softcap, varlen=varlen, head_dim_v=head_dim_v, long=long)
    except (ValueError, RuntimeError):
        return 0
    specs = call_specs(main, sink)
    return warm.start([s for s in specs if s not in gpu.modules], "backward", describe(main))


def call_group_splits(capability: tuple[int, int], device: int, head_dim: int, causal: bool,
                      q_shape: tuple[int, ...], k_shape: tuple[int, ...], deterministic: bool, *,
                      window: bool = False, softcap: bool = False, head_dim_v: int = 0) -> int:
    """Over how many CTAs the call's main kernel splits each GQA group (``backward_group_splits``
    of its config's key blocks on device ``device``): 1 in deterministic mode, for MHA and where
    the call's config is not of a family with ``group_splits`` (the mma.sync backward) or is the
    Hopper backward's unswapped tile (``WsBackwardConfig.swapped``: (192, 128)); > 1 runs
    the main kernel's split build (``backward_kernels(group_split=True)``)."""
    batch, seqlen_q, heads_q, _ = q_shape
    _, seqlen_k, heads_kv, _ = k_shape
    if deterministic or heads_q == heads_kv:
        return 1
    gpu = gpu_state.GPU
    config = configs.backward_config(capability, head_dim, causal, gpu.shared_limit(device), window=window,
                                     softcap=softcap, head_dim_v=head_dim_v,
                                     long=configs.backward_is_long(seqlen_q))
    if not family_of(config).group_splits or not config.swapped:  # the (192, 128) tile has no split build
        return 1
    return backward_group_splits(-(-seqlen_k // config.block_n), heads_kv, batch, heads_q // heads_kv,
                                 gpu.sm_count(device), deterministic)


def call_workspace(config: Any, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                   splits: int = 1) -> WorkspaceLayout:
    """The workspace's layout of a call of ``config`` with q and k of these shapes, its GQA groups
    split over ``splits`` CTAs (``call_group_splits``): where > 1 it also holds the dK and dV sums
    of every key block and their tickets."""
    batch, seqlen_q, heads_q, head_dim = q_shape
    _, seqlen_k, heads_kv, _ = k_shape
    split_blocks = -(-seqlen_k // config.block_n) * heads_kv * batch if splits > 1 else 0
    return workspace_layout(batch, heads_q, seqlen_q, head_dim, config.block_m, split_blocks, config.block_n)


def launch_all(kernels: BackwardKernels, call: BackwardCall) -> None:
    """The three kernels of one call, in order, on ``call.stream``."""
    gpu = gpu_state.GPU
    for launcher, launch in (kernels.prep, kernels.main, kernels.dq):
        launch(launcher, call, gpu)


def _dense(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Element strides of a C-contiguous 4-D array of ``shape``."""
    _, s, h, d = shape
    return s * h * d, h * d, d, 1


def _gradient(given: Operand | None, ref: Operand) -> tuple[Any, int]:
    """(array, device pointer) of a gradient: the given one, or a new C-contiguous device array
    like ``ref`` (its library, shape and dtype)."""
    if given is not None:
        return given.obj, given.pointer
    array = empty_like(ref.obj, ref.shape, ref.dtype_name)
    return array, device_pointer(array)


def zeroed_sink_gradient(ref: Any, heads_q: int, stream: int) -> tuple[Any, tuple[int, int]]:
    """A new float32 (heads_q,) d_sink of ``ref``'s library (``torch.empty`` for torch), zeroed by
    the driver on ``stream`` (the call's: ordered before its prepare kernel, CUDA-graph safe), and
    its ``(pointer, elements)``."""
    from cuda.bindings import driver

    d_sink = empty_lse(ref, (heads_q,))
    pointer = device_pointer(d_sink)
    _call(driver.cuMemsetD32Async(pointer, 0, heads_q, stream), "zeroing d_sink")
    return d_sink, (pointer, heads_q)


class BackwardPlan(NamedTuple):
    """What a validated device call of one layout (``plan_key``) needs at launch, worked out
    once: ``fire(stream, dout, q, k, v, out, lse, dq, dk, dv, workspace)`` (device pointers; a
    sink call's sink and d_sink after them: ``bind_all``), the device, the float32 workspace's
    elements, heads_q (d_sink's length), and what the per-call checks of given gradients read:
    the extents in bytes of dout, q, k, v, out, lse, dq, dk, dv (a new gradient's: its dense
    extent); ``splits``: over how many CTAs the main kernel splits each GQA group
    (``call_group_splits``; > 1: the split build, the workspace holds the dK / dV sums and tickets,
    and ``fire`` zeroes them on its stream before the main kernel)."""

    fire: Callable[..., None]
    device: int
    workspace: int
    heads_q: int
    spans: tuple[int, ...]
    splits: int = 1


def plan_key(device: int, dtype_name: str, causal: bool, scale: float, deterministic: bool,
             window_size: tuple[int, int], softcap: float, ops: tuple[Operand, ...],
             grads: tuple[Operand | None, Operand | None, Operand | None], sink: bool) -> tuple:
    """The key of a backward call's plan in ``GPU.plans`` (the forward's and decode's share the
    dict: this one starts with "backward"): the device, the dtype, the flags, the validated scale
    (a float: the default's too), window (a tuple of two ints) and softcap (a float), the shapes
    and strides of q, k, v, dout, out and lse (``ops``, in that order), None where no gradient is
    given, else each given gradient's shape and strides (None for one not given), and "sink" last
    for a learnable sink's call. ``run_torch`` builds the same key from torch's metadata.

    The key decides the GQA split (``call_group_splits``) too, with nothing added: it is a function
    of the device's capability, shared-memory limit and SM count (each fixed for a device ordinal
    in a process: ``GPU.sm_count`` is read once and kept), of the config (head dim, causality,
    window, softcap, V's head dim: all from the key), of batch, seqlen_k and the heads (the shapes)
    and of ``deterministic`` (the flags); a forced config makes no plan. So one key never serves
    both a split and an unsplit call (``tests/test_backward_plan_cpu.py``)."""
    q, k, v, do, o, lse = ops
    key = ("backward", device, dtype_name, causal, scale, deterministic, window_size, softcap,
           q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, do.shape, do.strides, o.shape,
           o.strides, lse.shape, lse.strides,
           None if grads == (None, None, None) else tuple(None if g is None else (g.shape, g.strides)
                                                          for g in grads))
    return (*key, "sink") if sink else key


def bind_all(kernels: BackwardKernels, call: BackwardCall, layout: WorkspaceLayout,
             gpu: Any) -> Callable[..., None]:
    """``fire(stream, dout, q, k, v, out, lse, dq, dk, dv, workspace, *sink)``: the three launches
    of ``call``'s layout bound once (``Launch.bind``), fired in order with the pointers of one
    call (the workspace's parts at ``layout``'s offsets from its base; ``sink``: a sink call's
    sink and d_sink pointers, the prepare kernel's last). Where ``layout`` holds a split GQA
    group's dK / dV sums and tickets (``call.group_splits`` > 1), the main kernel's bound launch
    (the split build's ``MappedLaunch``) takes their pointers too, and zeroes them on the stream
    first."""
    prep = kernels.prep[1].bind(kernels.prep[0], call, gpu)
    main = kernels.main[1].bind(kernels.main[0], call, gpu)
    dq_launch = kernels.dq[1].bind(kernels.dq[0], call, gpu)
    at_lse2, at_delta, at_accum, at_counters = (4 * layout.lse_log2, 4 * layout.delta, 4 * layout.dq_accum,
                                                4 * layout.counters)
    if layout.dkv_elements:
        at_sums, at_tickets = 4 * layout.dkv_accum, 4 * layout.tickets

        def fire_split(stream: int, do: int, q: int, k: int, v: int, o: int, lse: int, dq: int, dk: int,
                       dv: int, workspace: int, *sink: int) -> None:
            lse2, delta, accum, counters = (workspace + at_lse2, workspace + at_delta, workspace + at_accum,
                                            workspace + at_counters)
            prep(stream, o, do, lse, delta, lse2, accum, counters, *sink)
            main(stream, q, k, v, do, dk, dv, lse2, delta, accum, counters, workspace + at_sums,
                 workspace + at_tickets)
            dq_launch(stream, accum, dq)

        return fire_split

    def fire(stream: int, do: int, q: int, k: int, v: int, o: int, lse: int, dq: int, dk: int, dv: int,
             workspace: int, *sink: int) -> None:
        lse2, delta, accum, counters = (workspace + at_lse2, workspace + at_delta, workspace + at_accum,
                                        workspace + at_counters)
        prep(stream, o, do, lse, delta, lse2, accum, counters, *sink)
        main(stream, q, k, v, do, dk, dv, lse2, delta, accum, counters)
        dq_launch(stream, accum, dq)

    return fire


def device_plan(dod: Operand, qd: Operand, kd: Operand, vd: Operand, od: Operand, lsed: Operand,
                grads: tuple[Operand | None, Operand | None, Operand | None], causal: bool, scale: float,
                deterministic: bool, capability: tuple[int, int], device: int,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                sink: bool = False) -> BackwardPlan:
    """The plan of a validated device call: from ``GPU.plans``, else made (the GQA split decided:
    ``call_group_splits``; the config picked, the kernels loaded: ``backward_kernels``, the split
    build where the call splits; the workspace laid out with the split's sums and tickets:
    ``call_workspace``; the launches bound: ``bind_all``) and kept there unless a config is forced
    (``forward.PLANS_KEPT`` plans of all operations, the oldest go first)."""
    gpu = gpu_state.GPU
    forced = bool(configs.OVERRIDES)
    key = plan_key(device, qd.dtype_name, causal, scale, deterministic, window_size, softcap,
                   (qd, kd, vd, dod, od, lsed), grads, sink)
    plan = None if forced else gpu.plans.get(key)
    if plan is not None:
        return plan
    batch, seqlen_q, heads_q, head_dim = qd.shape
    var = backward_variant(causal, window_size, softcap, scale, seqlen_q, kd.shape[1])
    head_dim_v = 0 if vd.shape[3] == head_dim else vd.shape[3]
    splits = call_group_splits(capability, device, head_dim, var.causal, qd.shape, kd.shape, deterministic,
                               window=var.window, softcap=var.softcap, head_dim_v=head_dim_v)
    kernels = backward_kernels(capability, device, head_dim, var.causal, qd.dtype_name == "bfloat16",
                               window=var.window, softcap=var.softcap, sink=sink, head_dim_v=head_dim_v,
                               group_split=splits > 1, long=configs.backward_is_long(seqlen_q))
    dqd, dkd, dvd = (given or Operand(name, ref.shape, ref.dtype_name, True, None, _dense(ref.shape), 0,
                                      device=ref.device)
                     for given, ref, name in zip(grads, (qd, kd, vd), ("dq", "dk", "dv"), strict=True))
    layout = call_workspace(kernels.config, qd.shape, kd.shape, splits)  # with the split's sums and tickets
    sink_args = ((0, heads_q), (0, heads_q)) if sink else (None, None)
    call = BackwardCall(dod, qd, kd, vd, od, dqd, dkd, dvd, (lsed.pointer, batch * heads_q * seqlen_q),
                        layout.at(0), layout.rows, var.scale_log2, np.float32(scale), deterministic, 0,
                        device, var.window_left, var.window_right, var.cap_scale, *sink_args,
                        group_splits=splits)
    spans = tuple((4 if op is lsed else 2) * op.span for op in (dod, qd, kd, vd, od, lsed, dqd, dkd, dvd))
    plan = BackwardPlan(bind_all(kernels, call, layout, gpu), device, layout.total, heads_q, spans, splits)
    if not forced:
        with gpu.lock:
            if len(gpu.plans) >= forward.PLANS_KEPT:
                del gpu.plans[next(iter(gpu.plans))]
            gpu.plans[key] = plan
    return plan


def run_device(dod: Operand, qd: Operand, kd: Operand, vd: Operand, od: Operand, lsed: Operand,
               grads: tuple[Operand | None, Operand | None, Operand | None], causal: bool, scale: float,
               deterministic: bool, capability: tuple[int, int], device: int,
               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               sink: Operand | None = None) -> tuple[Any, ...]:
    """The backward on device arrays: the call's plan (``device_plan``), the gradients not given
    and a workspace of the inputs' library (``torch.empty`` for torch, so that the caching
    allocator and CUDA-graph capture work; ``cupy.empty``; a Numba device array otherwise), then
    the three launches on the inputs' stream. ``grads``: the operands of the given dq, dk, dv
    (None: a new array like q, k or v); ``window_size`` and ``softcap`` validated as the
    forward's; ``sink``: a learnable sink's validated operand (``operands.describe_sink``).
    Returns (dq, dk, dv), and d_sink (float32 (heads_q,)) after them with a sink."""
    plan = device_plan(dod, qd, kd, vd, od, lsed, grads, causal, scale, deterministic, capability, device,
                       window_size, softcap, sink is not None)
    dq, dq_pointer = _gradient(grads[0], qd)
    dk, dk_pointer = _gradient(grads[1], kd)
    dv, dv_pointer = _gradient(grads[2], vd)
    workspace = empty_lse(qd.obj, (plan.workspace,))  # float32; the prepare kernel and the memset fill it
    stream = stream_handle(qd)
    d_sink, sink_pointers = None, ()
    if sink is not None:
        d_sink, zeroed = zeroed_sink_gradient(qd.obj, plan.heads_q, stream)
        sink_pointers = (sink.pointer, zeroed[0])
    plan.fire(stream, dod.pointer, qd.pointer, kd.pointer, vd.pointer, od.pointer, lsed.pointer, dq_pointer,
              dk_pointer, dv_pointer, device_pointer(workspace), *sink_pointers)
    return (dq, dk, dv) if sink is None else (dq, dk, dv, d_sink)


def run_torch(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: Any, softmax_scale: Any,
              deterministic: Any, dq: Any, dk: Any, dv: Any, window_size: Any = (-1, -1), softcap: Any = 0.0,
              learnable_sink: Any = None) -> tuple[Any, ...] | None:
    """The backward on torch tensors whose layout was validated before (a plan in ``GPU.plans``):
    the per-call checks (CUDA tensors of q's dtype on the current device, lse float32; dout, q, k,
    v, out and given gradients 16-byte aligned, lse 4-byte; given gradients overlapping no input
    and no other gradient, by extent; a learnable sink float32 (heads_q,), contiguous,
    ``torch_small_pointer``), the allocations (``new_empty``: the caching allocator, on the
    current stream) and the plan's fire. None where it cannot tell that the call is good: the
    full path (``entry.direct_flash_attention_backward``) then runs and gives the errors (given
    gradients whose extents overlap but share no element, as the interleaved halves of one packed
    dK/dV array, take it too). Flags, scale, window and softcap must be of the validated types
    (bools, None or a float, a tuple of two ints, a float)."""
    gpu = gpu_state.GPU
    plans = gpu.plans
    if (not plans or configs.OVERRIDES or (causal is not True and causal is not False)
            or (deterministic is not True and deterministic is not False)
            or (softmax_scale is not None and type(softmax_scale) is not float)
            or type(softcap) is not float or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    types = TORCH_TYPES
    if (type(q) not in types or type(k) not in types or type(v) not in types or type(dout) not in types
            or type(out) not in types or type(lse) not in types):
        return None
    dtype = q.dtype
    name = TORCH_DTYPE_NAMES.get(dtype)
    device = q.get_device()
    if (name is None or k.dtype is not dtype or v.dtype is not dtype or dout.dtype is not dtype
            or out.dtype is not dtype or lse.dtype is not FLOAT32[0]
            or not (q.is_cuda and k.is_cuda and v.is_cuda and dout.is_cuda and out.is_cuda and lse.is_cuda)
            or k.get_device() != device or v.get_device() != device or dout.get_device() != device
            or out.get_device() != device or lse.get_device() != device):
        return None
    q_shape = q.shape
    given = None
    if dq is not None or dk is not None or dv is not None:
        for x in (dq, dk, dv):
            if x is not None and not (type(x) in types and x.dtype is dtype and x.is_cuda
                                      and x.get_device() == device):
                return None
        given = tuple(None if x is None else (x.shape, x.stride()) for x in (dq, dk, dv))
    scale = (1.0 / math.sqrt(q_shape[3])) if softmax_scale is None else softmax_scale  # check_softmax_scale's
    key = ("backward", device, name, causal, scale, deterministic, window_size, softcap, q_shape, q.stride(),
           k.shape, k.stride(), v.shape, v.stride(), dout.shape, dout.stride(), out.shape, out.stride(),
           lse.shape, lse.stride(), given)  # plan_key's
    sink = ()
    if learnable_sink is not None:
        pointer = torch_small_pointer(learnable_sink, FLOAT32[0], q_shape[2], device)
        if pointer is None:
            return None
        key, sink = (*key, "sink"), (pointer,)
    plan = plans.get(key)
    if plan is None or gpu.current()[1] != device:
        return None
    dop, qp, kp, vp, op, lp = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                               lse.data_ptr())
    if (dop | qp | kp | vp | op) & 15 or lp & 3:
        return None
    if given is not None:
        pointers = [dop, qp, kp, vp, op, lp] + [0 if x is None else x.data_ptr() for x in (dq, dk, dv)]
        if _given_overlap(pointers, plan.spans):
            return None
    dq = q.new_empty(q_shape) if dq is None else dq  # q's dtype and device, contiguous (as empty_like)
    dk = k.new_empty(k.shape) if dk is None else dk
    dv = v.new_empty(v.shape) if dv is None else dv
    workspace = q.new_empty((2 * plan.workspace,))  # the float32 workspace as 16-bit elements
    stream = torch_stream(device)
    if sink:
        d_sink, zeroed = zeroed_sink_gradient(q, plan.heads_q, stream)
        sink = (sink[0], zeroed[0])
    plan.fire(stream, dop, qp, kp, vp, op, lp, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
              workspace.data_ptr(), *sink)
    return (dq, dk, dv, d_sink) if sink else (dq, dk, dv)


def _given_overlap(pointers: list[int], spans: tuple[int, ...]) -> bool:
    """Whether a given gradient (pointers[6:], 0: not given) is misaligned or its extent overlaps
    an input's (dout, q, k, v, out, lse: pointers[:6]) or another given gradient's (``spans``:
    the extents in bytes, ``BackwardPlan.spans``)."""
    for i in range(6, 9):
        pointer = pointers[i]
        if not pointer:
            continue
        if pointer & 15:
            return True
        end = pointer + spans[i]
        for j in range(9):
            other = pointers[j]
            if j != i and other and other < end and pointer < other + spans[j]:
                return True
    return False


class HostLayout(NamedTuple):
    """Byte offsets of one numpy call's arrays in its device allocation (256-byte aligned): the
    inputs (copied in as one block, from ``inputs`` bytes of pinned memory), the gradients
    (copied out as one block of ``grads`` bytes), then the workspace."""

    offsets: dict[str, int]
    inputs: int
    grads: int
    total: int


def host_layout(shapes: dict[str, tuple[int, ...]], itemsizes: dict[str, int],
                workspace_bytes: int) -> HostLayout:
    """Where each array of ``shapes`` (inputs dout, q, k, v, out, lse, then gradients dq, dk, dv,
    in that order) sits, 256-byte aligned."""
    offsets, at = {}, 0
    inputs = 0
    for name in ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"):
        if name == "dq":
            inputs = at
        offsets[name] = at
        at += -(-math.prod(shapes[name]) * itemsizes[name] // 256) * 256
    return HostLayout(offsets, inputs, at - inputs, at + workspace_bytes)


def run_numpy(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
              lse: np.ndarray, grads: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None],
              causal: bool, scale: float, deterministic: bool, capability: tuple[int, int],
              device: int, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backward on numpy arrays, staged synchronously: the inputs are gathered into one block
    of page-locked memory (``runtime.pipeline.pinned_empty``, from the pooled pinned memory) and
    copied to one device allocation in one copy; the three kernels run on a stream of their own;
    dq, dk, dv come back in one copy into pooled pinned memory. Returns them there as numpy
    arrays, or writes them into the given ``grads`` (dq, dk, dv: None for a new array)."""
    from cuda.bindings import driver

    from ..runtime.pipeline import pinned_empty

    batch, seqlen_q, heads_q, head_dim = q.shape
    dtype_name = "bfloat16" if q.dtype != np.float16 else "float16"
    var = backward_variant(causal, window_size, softcap, scale, seqlen_q, k.shape[1])
    head_dim_v = 0 if v.shape[3] == head_dim else v.shape[3]
    splits = call_group_splits(capability, device, head_dim, var.causal, q.shape, k.shape, deterministic,
                               window=var.window, softcap=var.softcap, head_dim_v=head_dim_v)
    kernels = backward_kernels(capability, device, head_dim, var.causal, dtype_name == "bfloat16",
                               window=var.window, softcap=var.softcap, head_dim_v=head_dim_v,
                               group_split=splits > 1, long=configs.backward_is_long(seqlen_q))
    ws = call_workspace(kernels.config, q.shape, k.shape, splits)
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    shapes = {**{name: x.shape for name, x in arrays.items()}, "dq": q.shape, "dk": k.shape, "dv": v.shape}
    itemsizes = {name: 4 if name == "lse" else 2 for name in shapes}
    lay = host_layout(shapes, itemsizes, 4 * ws.total)
    staged = pinned_empty((lay.inputs,), np.uint8)
    for name, x in arrays.items():
        start = lay.offsets[name]
        view = staged[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
        np.copyto(view, x)
    results = pinned_empty((lay.grads,), np.uint8)
    stream = _call(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
                          "creating a stream")
    base = 0
    try:
        base = int(_call(driver.cuMemAlloc(lay.total), f"allocating {lay.total} device bytes"))
        _call(driver.cuMemcpyHtoDAsync(base, staged.ctypes.data, lay.inputs, stream),
                     "copying the inputs to the device")

        def dense(name: str) -> Operand:
            return Operand(name, shapes[name], dtype_name, True, None, _dense(shapes[name]),
                           base + lay.offsets[name])

        call = BackwardCall(dense("dout"), dense("q"), dense("k"), dense("v"), dense("out"), dense("dq"),
                            dense("dk"), dense("dv"), (base + lay.offsets["lse"], lse.size),
                            ws.at(base + lay.total - 4 * ws.total), ws.rows, var.scale_log2,
                            np.float32(scale), deterministic, int(stream), device, var.window_left,
                            var.window_right, var.cap_scale, group_splits=splits)
        launch_all(kernels, call)
        _call(driver.cuMemcpyDtoHAsync(results.ctypes.data, base + lay.inputs, lay.grads, stream),
                     "copying the gradients to the host")
        _call(driver.cuStreamSynchronize(stream), "running the backward")
    finally:
        driver.cuStreamSynchronize(stream)  # after a failure too: nothing may still use the memory
        if base:
            driver.cuMemFree(base)
        driver.cuStreamDestroy(stream)
    given = dict(zip(("dq", "dk", "dv"), grads, strict=True))
    found = []
    for name in ("dq", "dk", "dv"):
        start = lay.offsets[name] - lay.inputs
        result = results[start:start + 2 * math.prod(shapes[name])].view(q.dtype).reshape(shapes[name])
        if given[name] is not None:
            given[name][...] = result
            result = given[name]
        found.append(result)
    return found[0], found[1], found[2]
