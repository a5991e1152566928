"""The e4m3 (FP8) forward on Hopper: ``flash_attention`` with ``float8_e4m3fn`` q, k and v.

FlashAttention-3's FP8 API: q, k, v in e4m3 with float32 descales of shape (batch, heads_kv)
(x = x8 · descale; q's heads share their KV head's), the output in bf16 (or fp16), the LSE in
float32. The kernel is the Hopper forward's e4m3 build (``kernels.forward_ws``, ``WsConfig.fp8``):
QKᵀ and PV as m64nNk32 wgmma. 8-bit wgmma operands are K-major only, so V is first copied here
into its transposed layout (``kernels.fp8_layout``: (batch, heads_kv, head_dim, keys), the keys
of each 32 in the order P's registers hold them); that copy is one pass over V.

Inputs: torch CUDA tensors, or numpy arrays of ``ml_dtypes.float8_e4m3fn`` (run through torch;
the output is then a numpy array of ``ml_dtypes.bfloat16`` or float16). Every check runs before
anything is compiled or launched.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import configs
from ..kernels.fp8_layout import padded_keys
from ..kernels.spec import kernel_spec
from ..runtime import device as gpu_state
from .forward import loaded_kernel, variant_of

MAX_SEQLEN_K = 65535 * 128 * 8  # the V prep's grid: 65535 runs of 8 tiles of 128 keys (``fp8_prep``)
OUT_DTYPES = ("bfloat16", "float16")


def _dtype_name(x: Any) -> str:
    """The dtype's name of a torch tensor or numpy array (``float8_e4m3fn``, ``bfloat16``, ...)."""
    dtype = x.dtype
    if type(x).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def check_dtypes(q: Any, k: Any, v: Any) -> None:
    """q, k and v all e4m3; TypeError naming the dtypes otherwise (mixed FP8 and 16-bit operands,
    or e5m2)."""
    names = [_dtype_name(x) for x in (q, k, v)]
    if any(n.startswith("float8_e5m2") for n in names):
        raise TypeError(f"FP8 attention takes e4m3 (float8_e4m3fn) q, k and v, not e5m2; got {names} "
                        "(numbaflash.fp8.quantize makes e4m3 inputs and their descales)")
    if any(n != "float8_e4m3fn" for n in names):
        raise TypeError("q, k and v must all be float8_e4m3fn (FP8 operands are not mixed with others); got "
                        f"q {names[0]}, k {names[1]}, v {names[2]}")


def _check_gpu(capability: tuple[int, int]) -> None:
    if capability[0] == 9:
        return
    if capability >= (8, 9):
        raise NotImplementedError("FP8 attention runs on Hopper (sm_90) only for now; this GPU is sm_"
                                  f"{capability[0]}{capability[1]} (its FP8 mma.sync kernel is not built "
                                  "yet)")
    raise RuntimeError(f"FP8 attention needs FP8 tensor cores (sm_89 or newer); this GPU is sm_"
                       f"{capability[0]}{capability[1]}")


def _check_layout(name: str, x: Any, element: int) -> None:
    """Head dim contiguous, outer strides and the pointer 16-byte aligned (TMA)."""
    strides = x.stride()
    if strides[-1] != 1:
        raise ValueError(f"{name}'s head dim must be contiguous (stride 1), got strides {tuple(strides)}")
    if any((s * element) % 16 for s, n in zip(strides[:-1], x.shape[:-1], strict=True) if n > 1):
        raise ValueError(f"{name}'s batch, sequence and head strides must be multiples of 16 bytes for the "
                         f"FP8 kernel's TMA loads, got {tuple(strides)} ({element}-byte elements)")
    if x.data_ptr() % 16:
        raise ValueError(f"{name}'s data must be 16-byte aligned")


def check_descale(torch, x: Any, name: str, shape: tuple[int, int]) -> None:
    """A descale is None or a float32 (batch, heads_kv) torch tensor."""
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor (float32, (batch, heads_kv) = {shape}), got "
                        f"{type(x).__name__}")
    if x.dtype != torch.float32 or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be float32 of shape (batch, heads_kv) = {shape}, got {x.dtype} "
                         f"{tuple(x.shape)}")


def _descale(torch, x: Any, name: str, shape: tuple[int, int], device: Any):
    """A checked descale as a contiguous float32 (batch * heads_kv,) tensor on ``device`` (ones
    for None)."""
    if x is None:
        return torch.ones(shape[0] * shape[1], dtype=torch.float32, device=device)
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, with q, got {x.device}")
    return x.contiguous().reshape(-1)


def flash_attention_fp8(q: Any, k: Any, v: Any, *, q_descale: Any = None, k_descale: Any = None,
                        v_descale: Any = None, causal: bool = False, softmax_scale: float | None = None,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        return_lse: bool = False, out: Any = None, learnable_sink: Any = None,
                        out_dtype: Any = None) -> Any:
    """The e4m3 forward (``flash_attention``'s FP8 inputs; see there). numpy inputs run through
    torch and come back as numpy arrays."""
    check_dtypes(q, k, v)
    if isinstance(q, np.ndarray) or isinstance(k, np.ndarray) or isinstance(v, np.ndarray):
        return _numpy_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, window_size,
                          softcap, return_lse, out, learnable_sink, out_dtype)
    import torch

    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        raise TypeError("FP8 q, k and v must all be torch tensors (or all numpy arrays), got "
                        f"{[type(x).__name__ for x in (q, k, v)]}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("the FP8 forward has no backward: call it under torch.no_grad(), or on "
                                  "tensors that do not require grad")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, seqlen, heads, head_dim), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or tuple(v.shape) != tuple(k.shape):
        raise ValueError("k and v must be (batch, seqlen_k, heads_kv, head_dim) with q's batch and head dim: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (FP8 has no separate "
                         "value head dim)")
    if head_dim not in configs.FP8_HEAD_DIMS:
        raise ValueError(f"FP8 attention takes head dims {configs.FP8_HEAD_DIMS}, got {head_dim}")
    if min(batch, seqlen_q, seqlen_k, heads_kv) < 1 or heads_q % heads_kv:
        raise ValueError(f"empty input, or heads_q ({heads_q}) not a multiple of heads_kv ({heads_kv})")
    if max(batch, heads_kv) > 65535 or seqlen_q >= 2**31 or seqlen_k > MAX_SEQLEN_K:
        raise ValueError("FP8 attention takes batch and heads_kv up to 65535, seqlen_q under 2^31 and "
                         f"seqlen_k up to {MAX_SEQLEN_K} (the V prep's grid), got batch {batch}, "
                         f"heads_kv {heads_kv}, seqlens {seqlen_q}, {seqlen_k}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, x, 1)
    out_name = "bfloat16" if out_dtype is None else str(out_dtype).removeprefix("torch.")
    if out_name not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a positive real, got {softmax_scale}")
    softcap = float(softcap)
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap}")
    left, right = (int(window_size[0]), int(window_size[1]))
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= -1, got {window_size}")
    pairs = (batch, heads_kv)
    named = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    for name, x in named:
        check_descale(torch, x, name, pairs)
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or not (q.device == k.device == v.device):
        raise ValueError(f"FP8 q, k and v must be on one CUDA device, got {q.device}, {k.device}, {v.device}")
    device = q.device
    descales = [_descale(torch, x, name, pairs, device) for name, x in named]
    sink = None
    if learnable_sink is not None:
        if (not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dtype != torch.float32
                or tuple(learnable_sink.shape) != (heads_q,) or learnable_sink.device != device):
            raise ValueError(f"learnable_sink must be a float32 ({heads_q},) tensor on {device}")
        sink = learnable_sink.contiguous()
    dtype = getattr(torch, out_name)
    if out is None:
        out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=dtype, device=device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != tuple(q.shape)
          or out.device != device):
        raise ValueError(f"out must be a {dtype} tensor of shape {tuple(q.shape)} on {device}")
    else:
        _check_layout("out", out, 2)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (1,), dtype=torch.float32, device=device)
    var = variant_of(causal, (left, right), softcap, scale, seqlen_q, seqlen_k)
    with torch.cuda.device(device):
        capability, ordinal = gpu_state.GPU.current()
        _check_gpu(capability)
        stream = torch.cuda.current_stream(device).cuda_stream
        vt = torch.empty((batch, heads_kv, head_dim, padded_keys(seqlen_k)), dtype=torch.uint8, device=device)
        transpose_v(v, vt, ordinal, stream)
        _launch(q, k, vt, out, lse, descales, sink, var, return_lse, ordinal, out_name, stream, heads_kv,
                seqlen_k)
    return (out, lse) if return_lse else out


def _launcher(spec, device: int, shared_bytes: int):
    """The loaded kernel of ``spec`` on ``device`` as a ``KernelLauncher`` (loaded once)."""
    from ..kernels.families import kernel_abi
    from ..runtime.launch import KernelLauncher, set_dynamic_shared_limit

    gpu = gpu_state.GPU
    key = (spec, device)
    ready = gpu.launchers.get(key)
    if ready is None:
        with gpu.lock:
            ready = gpu.launchers.get(key)
            if ready is None:
                kernel, name = loaded_kernel(spec)
                if shared_bytes:
                    set_dynamic_shared_limit(kernel.handle, device, shared_bytes)
                ready = gpu.launchers[key] = KernelLauncher(kernel, kernel_abi(spec), name)
    return ready


def transpose_v(v: Any, vt: Any, device: int, stream: int) -> None:
    """V (batch, seqlen_k, heads_kv, head_dim) e4m3, head dim contiguous, 16-byte aligned strides
    -> ``vt`` (batch, heads_kv, head_dim, padded keys) uint8, contiguous: the e4m3 kernel's V
    (``kernels.fp8_prep``: keys in ``fp8_layout`` order, zero past seqlen_k), on ``stream``."""
    from ..kernels import params
    from ..kernels.fp8_prep import KEYS_PER_CTA, THREADS, TILE_RUN

    batch, seqlen_k, heads_kv, head_dim = v.shape
    config = configs.FP8_DEFAULTS[head_dim]
    spec = kernel_spec("sm90", "fp8_v", config, "float16", "sm_90a")
    keys = vt.shape[3]
    sb, ss, sh, _ = v.stride()
    span = (sum((n - 1) * st for n, st in zip(v.shape, v.stride(), strict=True)) + 4) // 4
    args = params.ordered(params.FP8_V, v=(v.data_ptr(), span), vt=(vt.data_ptr(), vt.numel() // 4),
                          v_sb=sb // 4, v_ss=ss // 4, v_sh=sh // 4, seqlen_k=seqlen_k, keys=keys,
                          heads_kv=heads_kv)
    grid = (heads_kv * TILE_RUN, -(-keys // (KEYS_PER_CTA * TILE_RUN)), batch)
    _launcher(spec, device, 0)(grid, THREADS, stream, 0, *args)


def _launch(q, k, vt, out, lse, descales, sink, var, write_lse: bool, device: int, out_name: str,
            stream: int, heads_kv: int, seqlen_k: int) -> None:
    """Encode the four tensor maps and launch the e4m3 kernel on ``stream``."""
    from ..kernels import params
    from ..kernels.families import kernel_params
    from ..runtime.map_slots import map_slots
    from ..runtime.tensor_map import encode_tensor_map

    gpu = gpu_state.GPU
    config = configs.FP8_DEFAULTS[q.shape[3]]
    spec = kernel_spec("sm90", "forward", config, out_name, "sm_90a", causal=var.causal, window=var.window,
                       softcap=var.softcap, sink=sink is not None)
    launcher = _launcher(spec, device, config.shared_bytes)
    batch, seqlen_q, heads_q, head_dim = q.shape
    out_map = "bf16" if out_name == "bfloat16" else "f16"
    maps_given = (
        (q.data_ptr(), tuple(q.shape), tuple(q.stride()), (1, config.block_m, 1, config.box_cols),
         f"{config.row_bytes}B", "u8"),
        (k.data_ptr(), tuple(k.shape), tuple(k.stride()), (1, config.block_n, 1, config.box_cols),
         f"{config.row_bytes}B", "u8"),
        (vt.data_ptr(), tuple(vt.shape), tuple(vt.stride()), (1, 1, head_dim, config.vt_row_bytes),
         f"{config.vt_row_bytes}B", "u8"),
        (out.data_ptr(), tuple(out.shape), tuple(2 * s for s in out.stride()),
         (1, 64, 1, config.o_box_cols), f"{config.o_row_bytes}B", out_map),
    )

    def encode():
        return np.stack([encode_tensor_map(pointer, shape, _byte_strides(shape, strides), box,
                                           swizzle=swizzle, dtype=dtype)
                         for pointer, shape, strides, box, swizzle, dtype in maps_given])

    slots = map_slots(device)
    tiles = -(-seqlen_q // config.block_m) * heads_q * batch
    grid = (min(tiles, gpu.sm_count(device)), 1, 1)
    span = {"q_descale": descales[0], "k_descale": descales[1], "v_descale": descales[2]}
    values = dict(lse=(lse.data_ptr(), lse.numel()), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  row_lead=config.first_block_lead(seqlen_q), heads_q=heads_q, group=heads_q // heads_kv,
                  batch_size=batch, scale_log2=var.scale_log2, write_lse=write_lse,
                  window_left=var.window_left, window_right=var.window_right, cap_scale=var.cap_scale,
                  **{name: (t.data_ptr(), t.numel()) for name, t in span.items()})
    if sink is not None:
        values["sink"] = (sink.data_ptr(), sink.numel())
    with slots.lock:
        key = ("fp8", config) + tuple(m[:3] for m in maps_given)  # the config fixes the boxes
        maps, slot = slots.address(key, encode, stream)
        try:
            args = params.ordered(kernel_params(spec), map_q=(maps, 16), map_k=(maps + 128, 16),
                                  map_v=(maps + 256, 16), map_o=(maps + 384, 16), **values)
            launcher(grid, config.threads, stream, config.shared_bytes, *args)
        finally:
            slots.used(slot, stream)


def _byte_strides(shape: tuple, strides: tuple) -> list[int]:
    """Byte strides (given already in bytes) with a size-1 dimension's stride made the extent of
    the dimensions inside it (a tensor map never steps it; a 0 or odd one would be refused)."""
    out, inner = [], strides[-1] * shape[-1]
    for n, st in zip(reversed(shape[:-1]), reversed(strides[:-1]), strict=True):
        out.append(st if n > 1 else inner)
        inner = out[-1] * n
    return [*reversed(out), strides[-1]]


def _numpy_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, window_size, softcap,
               return_lse, out, learnable_sink, out_dtype):
    """numpy ml_dtypes e4m3 inputs: through torch on the current device, back as numpy."""
    try:
        import torch
    except ImportError as error:  # pragma: no cover - torch is how FP8 numpy inputs reach the GPU
        raise NotImplementedError("FP8 numpy inputs need torch (to move them to the GPU)") from error
    if not all(isinstance(x, np.ndarray) for x in (q, k, v)):
        raise TypeError("FP8 q, k and v must all be numpy arrays (or all torch tensors)")
    if out is not None or learnable_sink is not None:
        raise NotImplementedError("FP8 numpy inputs take no out= or learnable_sink=")

    def to_gpu(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).cuda().view(torch.float8_e4m3fn)

    def descale(x):
        return None if x is None else torch.from_numpy(np.asarray(x, dtype=np.float32)).cuda()

    result = flash_attention_fp8(to_gpu(q), to_gpu(k), to_gpu(v), q_descale=descale(q_descale),
                                 k_descale=descale(k_descale), v_descale=descale(v_descale), causal=causal,
                                 softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                 return_lse=return_lse, out_dtype=out_dtype)
    o, lse = result if return_lse else (result, None)
    if o.dtype == torch.bfloat16:
        import ml_dtypes

        o_host = o.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    else:
        o_host = o.cpu().numpy()
    return (o_host, lse.cpu().numpy()) if return_lse else o_host
