"""Host side of the warp-specialised Hopper kernel (``forward_ws``): tensor maps, persistent
grid, launch. Not wired into ``flash_attention`` yet: ``flash_attention_ws`` takes torch CUDA
tensors and is what the tests and benchmarks call.

    out, lse = flash_attention_ws(q, k, v, causal=True, return_lse=True)

Tensor maps are 4-D over (batch, seqlen, heads, head_dim) with the caller's strides, boxes
of 64 head-dim columns (128-byte swizzle) by ``block_m`` (Q), ``block_n`` (K, V) or 64 (O)
rows; they are encoded per distinct (pointer, shape, strides) and kept in a small cache.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .shapes import WsConfig

DEFAULTS = {
    64: WsConfig(64, block_n=128, stages=3, overlap=True, pingpong=True),
    128: WsConfig(128, block_n=128, stages=2, overlap=True, pingpong=True),
}
_LOCK = threading.Lock()
_LAUNCHERS: dict = {}
_MAPS: dict = {}
MAX_CACHED_MAPS = 64
_SM_COUNT: dict = {}


def ws_cubin(config: WsConfig, causal: bool, bf16: bool, arch: str = "sm_90a"):
    """The cubin (``runtime.cache.CacheEntry``) of one kernel: from the on-disk cache or compiled."""
    from ..runtime.cache import cached_cubin

    def build():
        from .forward_ws import WS_ARGTYPES, make_forward_ws_kernel

        return make_forward_ws_kernel(config, causal, bf16), WS_ARGTYPES

    return cached_cubin("forward_ws", config, causal, bf16, arch, build)


def _launcher(config: WsConfig, causal: bool, bf16: bool, device: int):
    key = (config, causal, bf16, device)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        with _LOCK:
            launcher = _LAUNCHERS.get(key)
            if launcher is None:
                from cuda.core import ObjectCode

                from ..runtime.launch import KernelLauncher, set_dynamic_shared_limit
                from .forward_ws import WS_ABI

                entry = ws_cubin(config, causal, bf16)
                kernel = ObjectCode.from_cubin(entry.cubin).get_kernel(entry.entry_name)
                set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
                launcher = _LAUNCHERS[key] = KernelLauncher(kernel, WS_ABI, entry.entry_name)
    return launcher


def _check(name: str, t, torch) -> None:
    if not t.is_cuda or t.dtype not in (torch.float16, torch.bfloat16) or t.dim() != 4:
        raise TypeError(f"{name} must be a 4-D float16/bfloat16 CUDA tensor")
    if t.stride(3) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
        raise ValueError(f"{name}: head_dim must be contiguous and rows 16-byte aligned "
                         f"(strides {t.stride()})")


def _tensor_maps(config: WsConfig, tensors, bf16: bool, torch):
    """Device uint64[4, 16] with the maps of q, k, v, o (cached by pointer, shape, strides)."""
    from ..runtime.tensor_map import encode_tensor_map

    key = (config.block_m, config.block_n, bf16) + tuple(
        (t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in tensors)
    maps = _MAPS.get(key)
    if maps is None:
        rows = (config.block_m, config.block_n, config.block_n, 64)
        words = [
            encode_tensor_map(t.data_ptr(), t.shape, [2 * s for s in t.stride()], (1, r, 1, 64),
                              swizzle="128B", dtype="bf16" if bf16 else "f16")
            for t, r in zip(tensors, rows, strict=True)
        ]
        maps = torch.from_numpy(np.stack(words).view(np.int64)).to(tensors[0].device)
        with _LOCK:
            if len(_MAPS) >= MAX_CACHED_MAPS:
                _MAPS.clear()
            _MAPS[key] = maps
    return maps


def sm_count(device: int, torch) -> int:
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


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
    config = config or DEFAULTS[d]
    if config.head_dim != d:
        raise ValueError(f"config is for head_dim {config.head_dim}, the inputs have {d}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _check("out", out, torch)
    bf16 = q.dtype == torch.bfloat16
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    launcher = _launcher(config, bool(causal), bf16, device)
    maps = _tensor_maps(config, (q, k, v, out), bf16, torch)
    if return_lse:
        if lse is None:
            lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
        if lse.shape != (batch, heads_q, seqlen_q) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"lse must be a contiguous float32 tensor of shape {(batch, heads_q, seqlen_q)}")
        lse_arg = (lse.data_ptr(), lse.numel())
    else:
        lse = None
        dummy = _LAUNCHERS.setdefault(("lse", device), torch.empty(1, dtype=torch.float32, device=q.device))
        lse_arg = (dummy.data_ptr(), 1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    tiles = -(-seqlen_q // config.block_m) * heads_q * batch
    ctas = min(tiles, grid or sm_count(device, torch))
    stream = torch.cuda.current_stream(q.device).cuda_stream
    row = maps.data_ptr()
    launcher((ctas, 1, 1), config.threads, stream, config.shared_bytes,
             (row, 16), (row + 128, 16), (row + 256, 16), (row + 384, 16), lse_arg,
             seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, batch,
             np.float32(scale * math.log2(math.e)), bool(return_lse))
    return (out, lse) if return_lse else out
