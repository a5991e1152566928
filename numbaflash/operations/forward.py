"""The forward operation: choose the config, load its kernel, launch it on device arrays, or
run the numpy pipeline (``runtime.pipeline``) over host arrays.

The hot path (device arrays, a kernel already loaded) is a dictionary lookup for the launcher
(``GPU.ready``, keyed by device, head dim, causality, dtype and sequence span) and one launch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import configs
from ..operands import Operand, device_pointer, empty_like, empty_lse, stream_handle
from ..runtime import device as gpu_state
from ..runtime.compiler import arch_of
from .families import family_of
from .launch_forward import ForwardCall

LOG2_E = math.log2(math.e)



def ready_key(device: int, head_dim: int, causal: bool, bf16: bool, seqlen: int | None) -> tuple:
    """The key of ``GPU.ready``, the launchers of unforced configs: what picks the config on a
    device (``configs.forward_config`` is memoised on the same inputs)."""
    return device, head_dim, causal, bf16, configs.seqlen_span(seqlen)


def forward_kernel(capability: tuple[int, int], device: int, head_dim: int, causal: bool, bf16: bool,
                   seqlen: int | None = None):
    """(launcher, config, launch) for this problem on the current device (ordinal ``device``).

    The config is the table's for this GPU, passing over entries that need more shared memory
    than the device gives a CTA (``configs.forward_config``), and taking its short- or
    long-sequence entry by ``seqlen`` (the longer of seqlen_q and seqlen_k).
    The cubin comes from the on-disk kernel cache (``runtime.cache``) or is compiled and stored
    there; it is loaded once per process, and its shared-memory limit is raised once per device.
    """
    gpu = gpu_state.GPU
    limit = gpu.shared_limit(device)
    config = configs.forward_config(capability, head_dim, causal, limit, seqlen)
    op = family_of(config).op("forward")
    key = (config, causal, bf16, capability, device)
    ready = gpu.launchers.get(key)
    if ready is None:
        if config.shared_bytes > limit:  # only a forced config gets here (force_config)
            raise RuntimeError(f"{config} needs {config.shared_bytes} bytes of shared memory a CTA; device "
                               f"{device} (sm_{capability[0]}{capability[1]}) allows {limit}")
        from ..runtime.launch import KernelLauncher, set_dynamic_shared_limit

        with gpu.lock:
            ready = gpu.launchers.get(key)
            if ready is None:
                kernel, name = loaded_kernel(config, causal, bf16, arch_of(capability))
                set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
                ready = (KernelLauncher(kernel, op.abi, name), config, op.prepare_launch(config))
                gpu.launchers[key] = ready
    if not configs.OVERRIDES:  # the hot path's table (run_device) holds unforced configs only
        gpu.ready[ready_key(device, head_dim, causal, bf16, seqlen)] = ready
    return ready


def loaded_kernel(config, causal: bool, bf16: bool, arch: str, operation: str = "forward"):
    """(cuda.core Kernel, entry name) of a kernel, loaded once per process (the loaded library
    serves every device; call with ``GPU.lock`` held)."""
    modules = gpu_state.GPU.modules
    key = (config, causal, bf16, arch, operation)
    if key not in modules:
        from cuda.core import ObjectCode

        entry = configs.kernel_cubin(config, causal, bf16, arch, operation)
        kernel = ObjectCode.from_cubin(entry.cubin).get_kernel(entry.entry_name)
        modules[key] = (kernel, entry.entry_name)
    return modules[key]


def run_device(q: Any, qd: Operand, kd: Operand, vd: Operand, od: Operand | None, out: Any,
               causal: bool, scale: float, return_lse: bool, capability, device: int):
    """The forward on device arrays: one launch on the inputs' stream."""
    batch, seqlen_q, heads_q, head_dim = qd.shape
    seqlen_k = kd.shape[1]
    bf16 = qd.dtype_name == "bfloat16"
    longest = seqlen_q if seqlen_q > seqlen_k else seqlen_k
    ready = None if configs.OVERRIDES else gpu_state.GPU.ready.get(ready_key(device, head_dim, causal, bf16,
                                                                              longest))
    launcher, config, launch = ready or forward_kernel(capability, device, head_dim, causal, bf16, longest)
    if out is None:
        out = empty_like(q, qd.shape, qd.dtype_name)
        od = Operand("out", qd.shape, qd.dtype_name, True, out, _dense(qd.shape), device_pointer(out))
    if return_lse:
        lse_obj = empty_lse(q, (batch, heads_q, seqlen_q))
        lse = (device_pointer(lse_obj), batch * heads_q * seqlen_q)
    else:
        lse_obj, lse = None, gpu_state.GPU.scratch_f32(device)
    scale_log2 = np.float32(scale * LOG2_E)
    call = ForwardCall(qd, kd, vd, od, lse, seqlen_k, kd.shape[2], scale_log2, return_lse,
                       stream_handle(qd), device)
    launch(launcher, call, gpu_state.GPU)
    return (out, lse_obj) if return_lse else out


def _dense(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Element strides of a C-contiguous 4-D array of ``shape``."""
    _, s, h, d = shape
    return s * h * d, h * d, d, 1


def run_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray | None, dtype_name: str,
              causal: bool, scale: float, return_lse: bool, capability, device: int):
    """The forward on numpy arrays: the chunked pipeline over pinned staging buffers and several
    streams. Results go to pooled pinned memory (the copy engines write them in place), or
    straight into ``out`` unless it shares memory with an input (then via a copy)."""
    from ..runtime.pipeline import pinned_empty, run_numpy_forward

    batch, seqlen_q, heads_q, head_dim = q.shape
    launcher, config, launch = forward_kernel(capability, device, head_dim, causal, dtype_name == "bfloat16",
                                              max(seqlen_q, k.shape[1]))
    scale_log2 = np.float32(scale * LOG2_E)
    direct = out is not None and not any(np.may_share_memory(out, x) for x in (q, k, v))
    result = out if direct else pinned_empty(q.shape, q.dtype)
    lse_host = pinned_empty((batch, heads_q, seqlen_q), np.float32) if return_lse else None

    def launch_chunk(lay, base: int, sub, stream: int) -> None:
        """The kernel on one chunk, whose q, k, v, o (and LSE) sit dense from ``base``."""
        def dense(name, shape, offset):
            return Operand(name, shape, dtype_name, True, None, _dense(shape), base + offset)

        lse_arg = ((base + lay.lse, math.prod(lay.lse_shape)) if return_lse
                   else gpu_state.GPU.scratch_f32(device))
        call = ForwardCall(dense("q", lay.q_shape, lay.q), dense("k", lay.kv_shape, lay.k),
                           dense("v", lay.kv_shape, lay.v), dense("out", lay.q_shape, lay.o), lse_arg,
                           sub.seqlen_k, sub.heads_kv, scale_log2, return_lse, stream, device)
        launch(launcher, call, gpu_state.GPU)

    run_numpy_forward(device, q, k, v, result, lse_host, launch_chunk, causal, config.block_m)
    if out is not None and not direct:
        out[...] = result
        result = out
    return (result, lse_host) if return_lse else result
