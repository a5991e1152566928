"""The warp-specialised Hopper kernel (``forward_ws``) on torch tensors with an explicit config and
grid, for tests and kernel experiments: the same launch path as ``flash_attention``
(``operations.launch_forward.launch_sm90``: tensor maps in ``runtime.map_slots``, the cubin from
``configs.kernel_cubin``),
with two knobs the API does not expose, any ``WsConfig`` and the number of CTAs.

    out, lse = flash_attention_ws(q, k, v, causal=True, return_lse=True, grid=2)
"""

from __future__ import annotations

import math

import numpy as np

from ..kernels.shapes import WsConfig

_LAUNCHERS: dict = {}
_UNUSED_LSE: dict = {}


def ws_cubin(config: WsConfig, causal: bool, bf16: bool, arch: str = "sm_90a"):
    """The cubin of one kernel: ``configs.kernel_cubin`` (the API's cache entry)."""
    from ..configs import kernel_cubin
    from ..kernels.families import spec_of

    return kernel_cubin(spec_of(config, "forward", bf16, arch, causal=causal))


def _launcher(config: WsConfig, causal: bool, bf16: bool, device: int):
    """The kernel of ``config``, loaded once per process as the API loads it."""
    key = (config, causal, bf16, device)
    if key not in _LAUNCHERS:
        from ..kernels.families import kernel_abi, spec_of
        from ..operations.forward import loaded_kernel
        from ..runtime.device import GPU
        from ..runtime.launch import KernelLauncher, set_dynamic_shared_limit

        spec = spec_of(config, "forward", bf16, "sm_90a", causal=causal)
        with GPU.lock:
            kernel, name = loaded_kernel(spec)
            set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
            _LAUNCHERS[key] = KernelLauncher(kernel, kernel_abi(spec), name)
    return _LAUNCHERS[key]


def _operand(name: str, t):
    from ..operands import Operand

    dtype = "bfloat16" if "bfloat16" in str(t.dtype) else "float16"
    return Operand(name, tuple(t.shape), dtype, True, t, tuple(t.stride()), t.data_ptr())


def _check(name: str, t, torch) -> None:
    if not t.is_cuda or t.dtype not in (torch.float16, torch.bfloat16) or t.dim() != 4:
        raise TypeError(f"{name} must be a 4-D float16/bfloat16 CUDA tensor")
    if t.stride(3) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
        raise ValueError(f"{name}: head_dim must be contiguous and rows 16-byte aligned "
                         f"(strides {t.stride()})")


def flash_attention_ws(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                       return_lse: bool = False, out=None, lse=None, config: WsConfig | None = None,
                       grid: int | None = None):
    """``flash_attention`` on the warp-specialised kernel, for torch CUDA tensors on a Hopper GPU.
    ``lse``: a float32 (batch, heads_q, seqlen_q) tensor to write the LSE into (with
    ``return_lse``); ``grid``: CTAs to launch (default: one per SM, at most one per tile)."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(name, t, torch)
    batch, seqlen_q, heads_q, d = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != d or heads_q % heads_kv:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError("q, k, v must have one dtype")
    if config is None:  # the tuned table's choice, as flash_attention makes it on Hopper
        from ..configs import forward_config

        config = forward_config((9, 0), d, bool(causal), seqlen=max(q.shape[1], k.shape[1]))
    if config.head_dim != d:
        raise ValueError(f"config is for head_dim {config.head_dim}, the inputs have {d}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _check("out", out, torch)
    bf16 = q.dtype == torch.bfloat16
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    launcher = _launcher(config, bool(causal), bf16, device)
    if return_lse:
        if lse is None:
            lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        if lse.shape != (batch, heads_q, seqlen_q) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"lse must be a contiguous float32 tensor of shape {(batch, heads_q, seqlen_q)}")
        lse_arg = (lse.data_ptr(), lse.numel())
    else:
        lse = None
        dummy = _UNUSED_LSE.setdefault(device, torch.empty(1, dtype=torch.float32, device=q.device))
        lse_arg = (dummy.data_ptr(), 1)
    from ..operations.launch_forward import ForwardCall, launch_sm90
    from ..runtime.device import GPU

    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    call = ForwardCall(*(_operand(n, t) for n, t in (("q", q), ("k", k), ("v", v), ("out", out))), lse_arg,
                       seqlen_k, heads_kv, np.float32(scale * math.log2(math.e)), bool(return_lse),
                       torch.cuda.current_stream(q.device).cuda_stream, device)
    launch_sm90(config, ctas=grid)(launcher, call, GPU)
    return (out, lse) if return_lse else out
