"""Decode against a KV cache on device arrays: the config
(``configs.decode_config``), its two kernels loaded once per device (``GPU.launchers``), the
split count (``launch_decode.decode_splits``), the output and the split scratch from the inputs'
library, and the launches on the inputs' stream."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import configs
from ..operands import Operand, device_pointer, empty_like, empty_lse, stream_handle
from ..runtime import device as gpu_state
from ..runtime.compiler import arch_of
from .families import DECODE_OPERATIONS, family_of
from .forward import loaded_kernel
from .launch_decode import DecodeCall, Launch, decode_splits, resident_ctas

LOG2_E = math.log2(math.e)


class DecodeKernels(NamedTuple):
    config: Any  # kernels.shapes.DecodeConfig
    decode: tuple[Any, Launch]
    combine: tuple[Any, Launch]
    ctas_per_sm: int  # decode CTAs an SM holds at once (registers and shared memory)


def decode_kernels(capability: tuple[int, int], device: int, head_dim: int, rows: int, paged: bool,
                   causal: bool, bf16: bool) -> DecodeKernels:
    """The config and the two loaded kernels of this problem on the current device."""
    gpu = gpu_state.GPU
    ready = gpu.launchers.get(("decode", capability, device, head_dim, rows > 16, paged, causal, bf16))
    if ready is not None and not configs.DECODE_FORCED:
        return ready
    config = configs.decode_config(capability, head_dim, rows, paged, gpu.shared_limit(device))
    key = ("decode", config, causal, bf16, capability, device)
    ready = gpu.launchers.get(key)
    if ready is None:
        from ..runtime.launch import KernelLauncher, kernel_registers, set_dynamic_shared_limit

        family = family_of(config)
        with gpu.lock:
            ready = gpu.launchers.get(key)
            if ready is None:
                parts = []
                ctas_per_sm = 1
                for operation in DECODE_OPERATIONS:
                    op = family.op(operation)
                    kernel, name = loaded_kernel(config, causal, bf16, arch_of(capability), operation)
                    if operation == "decode":
                        set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
                        ctas_per_sm = resident_ctas(config.threads, kernel_registers(kernel.handle, device),
                                                    config.shared_bytes, gpu.shared_limit(device))
                    parts.append((KernelLauncher(kernel, op.abi, name), op.prepare_launch(config)))
                ready = gpu.launchers[key] = DecodeKernels(config, *parts, ctas_per_sm)
    if not configs.DECODE_FORCED:  # the problem's own config: found by the shapes next time
        gpu.launchers[("decode", capability, device, head_dim, rows > 16, paged, causal, bf16)] = ready
    return ready


def run_device(qd: Operand, kcd: Operand, vcd: Operand, knd: Operand | None, vnd: Operand | None,
               seqd: Operand, btd: Operand | None, outd: Operand | None, causal: bool, scale: float,
               num_splits: int, return_lse: bool, capability: tuple[int, int],
               device: int) -> tuple[Any, Any]:
    """Launch decode (and combine) on the inputs' stream; returns (out, lse or None)."""
    gpu = gpu_state.GPU
    batch, seqlen_q, heads_q, head_dim = qd.shape
    heads_kv = kcd.shape[2]
    group = heads_q // heads_kv
    rows = group * seqlen_q
    paged = btd is not None
    kernels = decode_kernels(capability, device, head_dim, rows, paged, causal, qd.dtype_name == "bfloat16")
    config = kernels.config
    row_blocks = -(-rows // config.rows)
    seqlen_new = knd.shape[1] if knd is not None else 0
    if paged:
        pages, capacity = btd.shape[1], kcd.shape[1]
        max_keys = pages * capacity
    else:
        pages, capacity = 0, kcd.shape[1]
        max_keys = capacity
    splits = num_splits or decode_splits(batch, heads_kv, row_blocks, max_keys + seqlen_new, config.block_n,
                                         gpu.sm_count(device), kernels.ctas_per_sm)
    scratch = gpu.scratch_f32(device)
    if outd is None:
        out = empty_like(qd.obj, qd.shape, qd.dtype_name)
        outd = Operand("out", qd.shape, qd.dtype_name, True, out,
                       (seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim, 1), device_pointer(out),
                       device=qd.device)
    lse = empty_lse(qd.obj, (batch, heads_q, seqlen_q)) if return_lse else None
    lse_arg = (device_pointer(lse), batch * heads_q * seqlen_q) if return_lse else scratch
    o_part = lse_part = scratch
    if splits > 1:
        n = batch * heads_q * seqlen_q * splits
        part = empty_lse(qd.obj, (n * (head_dim + 1),))
        base = device_pointer(part)
        o_part, lse_part = (base, n * head_dim), (base + 4 * n * head_dim, n)
    table = None if btd is None else (btd.pointer, 1)
    call = DecodeCall(qd, kcd, vcd, knd, vnd, (seqd.pointer, batch), table,
                      btd.strides[0] if paged else 0, pages, capacity, outd, lse_arg, o_part, lse_part,
                      splits, row_blocks, np.float32(scale * LOG2_E), return_lse, stream_handle(qd),
                      scratch[0])
    for launcher, launch in (kernels.decode, kernels.combine):
        launch(launcher, call, gpu)
    return outd.obj, lse
