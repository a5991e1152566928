"""The backward operation: choose the config, load its three kernels (prepare, main, dQ), and
launch them on device arrays, or stage numpy arrays through page-locked memory and run them.

After the first call on a device, the device path is a dictionary lookup for the launchers
(``GPU.launchers``, keyed by device, head dim, causality, dtype and the main kernel's variant),
one workspace allocation of the inputs' library, and three launches on the inputs' stream
(``launch_backward``).

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
from typing import Any, NamedTuple

import numpy as np

from .. import configs
from ..kernels.families import BACKWARD_OPERATIONS, family_of, kernel_abi
from ..kernels.spec import KernelSpec, kernel_spec
from ..operands import Operand, device_pointer, empty_like, empty_lse, stream_handle
from ..runtime import device as gpu_state
from ..runtime.cache import describe
from ..runtime.compiler import arch_of
from . import warm
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
              group_split: bool = False) -> tuple:
    """The key in ``GPU.launchers`` of the kernels an unforced call runs: what picks the config on
    a device (``configs.backward_config`` is memoised on the same inputs), the main kernel's
    variant (``Variant.window``, ``Variant.softcap``, packed sequences, the GQA split) and whether
    the prepare kernel is the learnable sink's build (V's head dim where it differs, and the GQA
    split: one element more each)."""
    key = "backward", device, head_dim, causal, bf16, window, softcap, varlen, sink
    key = (*key, head_dim_v) if head_dim_v else key
    return (*key, "group_split") if group_split else key


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
                     group_split: bool = False) -> BackwardKernels:
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
    family with ``group_splits`` only: ``call_group_splits`` > 1).
    """
    gpu = gpu_state.GPU
    hot = ready_key(device, head_dim, causal, bf16, window, softcap, varlen, sink, head_dim_v, group_split)
    if not configs.OVERRIDES:
        ready = gpu.launchers.get(hot)
        if ready is not None:
            return ready
    limit = gpu.shared_limit(device)
    config, main = backward_specs(capability, limit, head_dim, causal, bf16, window=window, softcap=softcap,
                                  varlen=varlen, head_dim_v=head_dim_v, group_split=group_split)
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
                   group_split: bool = False) -> tuple[Any, KernelSpec]:
    """(config, main kernel's spec) of a call on a GPU of ``capability`` giving a CTA ``limit`` bytes
    of shared memory (None: ``configs.max_shared_bytes``): ``configs.backward_config``'s config, the
    main kernel's spec for the GPU's own target; ``main.sibling(operation)`` for each of
    ``BACKWARD_OPERATIONS`` gives the call's three kernels.

    ``group_split``: the main kernel's GQA-split build (``KernelSpec.group_split``).

    Raises what ``configs.backward_config`` raises (a head dim with no backward, no config that fits)."""
    config = configs.backward_config(capability, head_dim, causal, limit, window=window, softcap=softcap,
                                     varlen=varlen, head_dim_v=head_dim_v)
    main = kernel_spec(family_of(config).name, "backward", config, "bfloat16" if bf16 else "float16",
                       arch_of(capability), causal=causal, window=window, softcap=softcap, varlen=varlen,
                       group_split=group_split)
    return config, main


# ready_key()s whose kernels were handed to the background compile (or found ready), so that a
# training loop's next forwards cost one lookup
_PREPARED: set = set()


def prepare_backward(capability: tuple[int, int], device: int, head_dim: int, causal: bool, bf16: bool, *,
                     window: bool = False, softcap: bool = False, varlen: bool = False,
                     sink: bool = False, head_dim_v: int = 0) -> int:
    """Start compiling, in worker processes, the kernels the backward of this call will load
    (``backward_kernels``' three, by ``backward_specs``), where they are neither loaded nor cached
    (``operations.warm``; the backward waits on them there); returns how many. What the forward
    runs when a backward will follow (its inputs require grad), before it compiles its own kernel.
    Once per problem kind (``ready_key``) and device; nothing under a forced config, and nothing
    where the backward has no config (it raises then, with the message)."""
    key = ready_key(device, head_dim, causal, bf16, window, softcap, varlen, sink, head_dim_v)
    if key in _PREPARED or configs.OVERRIDES or not warm.enabled():
        return 0
    _PREPARED.add(key)
    gpu = gpu_state.GPU
    if key in gpu.launchers:
        return 0
    try:
        _, main = backward_specs(capability, gpu.shared_limit(device), head_dim, causal, bf16, window=window,
                                 softcap=softcap, varlen=varlen, head_dim_v=head_dim_v)
    except (ValueError, RuntimeError):
        return 0
    specs = call_specs(main, sink)
    return warm.start([s for s in specs if s not in gpu.modules], "backward", describe(main))


def call_group_splits(capability: tuple[int, int], device: int, head_dim: int, causal: bool,
                      q_shape: tuple[int, ...], k_shape: tuple[int, ...], deterministic: bool, *,
                      window: bool = False, softcap: bool = False, head_dim_v: int = 0) -> int:
    """Over how many CTAs the call's main kernel splits each GQA group (``backward_group_splits``
    of its config's key blocks on device ``device``): 1 in deterministic mode, for MHA and where
    the call's config is not of a family with ``group_splits`` (the mma.sync backward); > 1 runs
    the main kernel's split build (``backward_kernels(group_split=True)``)."""
    batch, _, heads_q, _ = q_shape
    _, seqlen_k, heads_kv, _ = k_shape
    if deterministic or heads_q == heads_kv:
        return 1
    gpu = gpu_state.GPU
    config = configs.backward_config(capability, head_dim, causal, gpu.shared_limit(device), window=window,
                                     softcap=softcap, head_dim_v=head_dim_v)
    if not family_of(config).group_splits:
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


def _gradient(given: Operand | None, ref: Operand, name: str) -> tuple[Any, Operand]:
    """(array, operand) of a gradient: the given one, or a new C-contiguous device array like
    ``ref`` (its library, shape and dtype)."""
    if given is not None:
        return given.obj, given
    array = empty_like(ref.obj, ref.shape, ref.dtype_name)
    return array, Operand(name, ref.shape, ref.dtype_name, True, array, _dense(ref.shape),
                          device_pointer(array), device=ref.device)


def zeroed_sink_gradient(ref: Any, heads_q: int, stream: int) -> tuple[Any, tuple[int, int]]:
    """A new float32 (heads_q,) d_sink of ``ref``'s library (``torch.empty`` for torch), zeroed by
    the driver on ``stream`` (the call's: ordered before its prepare kernel, CUDA-graph safe), and
    its ``(pointer, elements)``."""
    from cuda.bindings import driver

    d_sink = empty_lse(ref, (heads_q,))
    pointer = device_pointer(d_sink)
    _call(driver.cuMemsetD32Async(pointer, 0, heads_q, stream), "zeroing d_sink")
    return d_sink, (pointer, heads_q)


def run_device(dod: Operand, qd: Operand, kd: Operand, vd: Operand, od: Operand, lsed: Operand,
               grads: tuple[Operand | None, Operand | None, Operand | None], causal: bool, scale: float,
               deterministic: bool, capability: tuple[int, int], device: int,
               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               sink: Operand | None = None) -> tuple[Any, ...]:
    """The backward on device arrays: a workspace of the inputs' library (``torch.empty`` for
    torch, so that the caching allocator and CUDA-graph capture work; ``cupy.empty``; a Numba
    device array otherwise), then the three launches on the inputs' stream. ``grads``: the
    operands of the given dq, dk, dv (None: a new array like q, k or v); ``window_size`` and
    ``softcap`` validated as the forward's; ``sink``: a learnable sink's validated operand
    (``operands.describe_sink``). Returns (dq, dk, dv), and d_sink (float32 (heads_q,)) after
    them with a sink."""
    batch, seqlen_q, heads_q, head_dim = qd.shape
    var = backward_variant(causal, window_size, softcap, scale, seqlen_q, kd.shape[1])
    head_dim_v = 0 if vd.shape[3] == head_dim else vd.shape[3]
    splits = call_group_splits(capability, device, head_dim, var.causal, qd.shape, kd.shape, deterministic,
                               window=var.window, softcap=var.softcap, head_dim_v=head_dim_v)
    kernels = backward_kernels(capability, device, head_dim, var.causal, qd.dtype_name == "bfloat16",
                               window=var.window, softcap=var.softcap, sink=sink is not None,
                               head_dim_v=head_dim_v, group_split=splits > 1)
    dq, dqd = _gradient(grads[0], qd, "dq")
    dk, dkd = _gradient(grads[1], kd, "dk")
    dv, dvd = _gradient(grads[2], vd, "dv")
    layout = call_workspace(kernels.config, qd.shape, kd.shape, splits)
    workspace = empty_lse(qd.obj, (layout.total,))  # float32; the prepare and main launches initialise it
    stream = stream_handle(qd)
    d_sink, sink_args = None, (None, None)
    if sink is not None:
        d_sink, zeroed = zeroed_sink_gradient(qd.obj, heads_q, stream)
        sink_args = ((sink.pointer, heads_q), zeroed)
    call = BackwardCall(dod, qd, kd, vd, od, dqd, dkd, dvd, (lsed.pointer, batch * heads_q * seqlen_q),
                        layout.at(device_pointer(workspace)), layout.rows, var.scale_log2,
                        np.float32(scale), deterministic, stream, device, var.window_left,
                        var.window_right, var.cap_scale, *sink_args, group_splits=splits)
    launch_all(kernels, call)
    return (dq, dk, dv) if sink is None else (dq, dk, dv, d_sink)


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
                               group_split=splits > 1)
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
