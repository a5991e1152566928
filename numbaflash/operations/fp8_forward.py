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
from collections import namedtuple
from typing import Any

import numpy as np

from .. import configs
from ..kernels.fp8_layout import KEY_GROUP, packed_vt_keys, padded_keys
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


Options = namedtuple("Options", ["out_name", "scale", "softcap", "window", "descales", "sink"])
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _options(torch, q: Any, k: Any, v: Any, pairs: tuple[int, int], descales: tuple, softmax_scale, softcap,
             window_size, learnable_sink, out_dtype) -> Options:
    """The checks the dense and packed FP8 calls share, before anything launches: output dtype,
    scale, softcap, window, descales of shape ``pairs`` = (batch, heads_kv), then q, k, v on one
    CUDA device, then the sink; with the descales made device tensors."""
    heads_q, head_dim = q.shape[-2], q.shape[-1]
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
    named = tuple(zip(DESCALE_NAMES, descales, strict=True))
    for name, x in named:
        check_descale(torch, x, name, pairs)
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or not (q.device == k.device == v.device):
        raise ValueError(f"FP8 q, k and v must be on one CUDA device, got {q.device}, {k.device}, {v.device}")
    device = q.device
    on_device = [_descale(torch, x, name, pairs, device) for name, x in named]
    sink = None
    if learnable_sink is not None:
        if (not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dtype != torch.float32
                or tuple(learnable_sink.shape) != (heads_q,) or learnable_sink.device != device):
            raise ValueError(f"learnable_sink must be a float32 ({heads_q},) tensor on {device}")
        sink = learnable_sink.contiguous()
    return Options(out_name, scale, softcap, (left, right), on_device, sink)


def _check_torch_inputs(torch, q: Any, k: Any, v: Any, dims: int, shape_names: str) -> None:
    """All torch tensors, none needing grad, of ``dims`` dimensions, k and v alike, a head dim with
    a kernel, heads_q a multiple of heads_kv, TMA's layout."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        raise TypeError("FP8 q, k and v must all be torch tensors (or all numpy arrays), got "
                        f"{[type(x).__name__ for x in (q, k, v)]}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("the FP8 forward has no backward: call it under torch.no_grad(), or on "
                                  "tensors that do not require grad")
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        raise ValueError(f"q, k, v must be {dims}-D ({shape_names}), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch_differs = dims == 4 and k.shape[0] != q.shape[0]
    if tuple(v.shape) != tuple(k.shape) or k.shape[-1] != q.shape[-1] or batch_differs:
        raise ValueError(f"k and v must be ({shape_names.replace('seqlen', 'seqlen_k')}) with q's "
                         f"{'batch and ' if dims == 4 else ''}head dim: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)} (FP8 has no separate value head dim)")
    head_dim, heads_q, heads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    if head_dim not in configs.FP8_HEAD_DIMS:
        raise ValueError(f"FP8 attention takes head dims {configs.FP8_HEAD_DIMS}, got {head_dim}")
    if min(*q.shape, *k.shape) < 1 or heads_q % heads_kv:
        raise ValueError(f"empty input, or heads_q ({heads_q}) not a multiple of heads_kv ({heads_kv}): q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, x, 1)


def _check_out(torch, out: Any, shape: tuple, dtype: Any, device: Any) -> Any:
    """``out`` checked (or made): ``dtype``, ``shape``, on ``device``, TMA's layout."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != tuple(shape)
            or out.device != device):
        raise ValueError(f"out must be a {dtype} tensor of shape {tuple(shape)} on {device}")
    _check_layout("out", out, 2)
    return out


def flash_attention_fp8(q: Any, k: Any, v: Any, *, q_descale: Any = None, k_descale: Any = None,
                        v_descale: Any = None, causal: bool = False, softmax_scale: float | None = None,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        return_lse: bool = False, out: Any = None, learnable_sink: Any = None,
                        out_dtype: Any = None) -> Any:
    """The e4m3 forward (``flash_attention``'s FP8 inputs; see there). numpy inputs run through
    torch and come back as numpy arrays."""
    check_dtypes(q, k, v)
    options = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=causal,
                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   return_lse=return_lse, out=out, learnable_sink=learnable_sink, out_dtype=out_dtype)
    if isinstance(q, np.ndarray) or isinstance(k, np.ndarray) or isinstance(v, np.ndarray):
        return _numpy_fp8(flash_attention_fp8, (q, k, v), (), options)
    import torch

    _check_torch_inputs(torch, q, k, v, 4, "batch, seqlen, heads, head_dim")
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if max(batch, heads_kv) > 65535 or seqlen_q >= 2**31 or seqlen_k > MAX_SEQLEN_K:
        raise ValueError("FP8 attention takes batch and heads_kv up to 65535, seqlen_q under 2^31 and "
                         f"seqlen_k up to {MAX_SEQLEN_K} (the V prep's grid), got batch {batch}, "
                         f"heads_kv {heads_kv}, seqlens {seqlen_q}, {seqlen_k}")
    opts = _options(torch, q, k, v, (batch, heads_kv), (q_descale, k_descale, v_descale), softmax_scale,
                    softcap, window_size, learnable_sink, out_dtype)
    device = q.device
    out = _check_out(torch, out, tuple(q.shape), getattr(torch, opts.out_name), device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (1,), dtype=torch.float32, device=device)
    var = variant_of(causal, opts.window, opts.softcap, opts.scale, seqlen_q, seqlen_k)
    with torch.cuda.device(device):
        capability, ordinal = gpu_state.GPU.current()
        _check_gpu(capability)
        stream = torch.cuda.current_stream(device).cuda_stream
        vt = torch.empty((batch, heads_kv, head_dim, padded_keys(seqlen_k)), dtype=torch.uint8, device=device)
        transpose_v(v, vt, ordinal, stream)
        _launch(q, k, vt, out, lse, opts, var, return_lse, ordinal, stream, heads_kv, seqlen_k)
    return (out, lse) if return_lse else out


def _check_offsets(torch, cu_seqlens_q: Any, cu_seqlens_k: Any, device: Any) -> int:
    """Torch offsets: int32 (batch + 1,) tensors of one length on q's device; returns batch. Their
    values are never read on the host (a call can be captured in a CUDA graph)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.device != device:
            where = f" on {cu.device}" if isinstance(cu, torch.Tensor) else ""
            raise TypeError(f"{name} must be an int32 torch tensor on q's device ({device}) for torch "
                            f"inputs, got {type(cu).__name__}{where}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise TypeError(f"{name} must be int32 of shape (batch + 1,) with batch >= 1, got {cu.dtype} "
                            f"{tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    return cu_seqlens_q.shape[0] - 1


def flash_attention_varlen_fp8(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                               max_seqlen_q: int, max_seqlen_k: int, *, q_descale: Any = None,
                               k_descale: Any = None, v_descale: Any = None, causal: bool = False,
                               softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                               softcap: float = 0.0, return_lse: bool = False, out: Any = None,
                               learnable_sink: Any = None, out_dtype: Any = None) -> Any:
    """The packed e4m3 forward (``flash_attention_varlen``'s FP8 inputs; see there): q (total_q,
    heads_q, head_dim), k and v (total_k, heads_kv, head_dim) e4m3; descales (batch, heads_kv), one
    row per sequence; out (total_q, heads_q, head_dim) bf16 or fp16, the LSE (heads_q, total_q).
    numpy inputs (and numpy offsets) run through torch and come back as numpy arrays."""
    from .varlen import check_max_seqlen, check_sequences

    check_dtypes(q, k, v)
    options = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=causal,
                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   return_lse=return_lse, out=out, learnable_sink=learnable_sink, out_dtype=out_dtype)
    if isinstance(q, np.ndarray) or isinstance(k, np.ndarray) or isinstance(v, np.ndarray):
        if not all(isinstance(x, np.ndarray) for x in (q, k, v)) or any(x.ndim != 3 for x in (q, k, v)):
            raise ValueError("FP8 numpy q, k and v must all be 3-D numpy arrays (total, heads, head_dim)")
        check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0], False)
        return _numpy_fp8(flash_attention_varlen_fp8, (q, k, v), (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                               max_seqlen_k), options)
    import torch

    _check_torch_inputs(torch, q, k, v, 3, "total, heads, head_dim")
    total_q, heads_q, head_dim = q.shape
    total_k, heads_kv, _ = k.shape
    batch = _check_offsets(torch, cu_seqlens_q, cu_seqlens_k, q.device)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if max(batch, heads_kv) > 65535 or max(total_q, total_k) >= 2**31 - packed_vt_keys(0, 65536):
        raise ValueError("packed FP8 attention takes up to 65535 sequences and KV heads and totals under "
                         f"2^31 - 2^21, got batch {batch}, heads_kv {heads_kv}, totals {total_q}, {total_k}")
    opts = _options(torch, q, k, v, (batch, heads_kv), (q_descale, k_descale, v_descale), softmax_scale,
                    softcap, window_size, learnable_sink, out_dtype)
    device = q.device
    out = _check_out(torch, out, tuple(q.shape), getattr(torch, opts.out_name), device)
    lse = torch.empty((heads_q, total_q) if return_lse else (1,), dtype=torch.float32, device=device)
    var = variant_of(causal, opts.window, opts.softcap, opts.scale, max_q, max_k)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    with torch.cuda.device(device):
        capability, ordinal = gpu_state.GPU.current()
        _check_gpu(capability)
        stream = torch.cuda.current_stream(device).cuda_stream
        vt = torch.empty((1, heads_kv, head_dim, packed_vt_keys(total_k, batch)), dtype=torch.uint8,
                         device=device)
        transpose_v_varlen(v, cu_k, vt, max_k, ordinal, stream)
        _launch(q[None], k[None], vt, out[None], lse, opts, var, return_lse, ordinal, stream, heads_kv, max_k,
                packed=Packed(cu_q, cu_k, batch, max_q, out))
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
    args = params.ordered(params.FP8_V, v=(v.data_ptr(), _word_span(v)), vt=(vt.data_ptr(), vt.numel() // 4),
                          v_sb=sb // 4, v_ss=ss // 4, v_sh=sh // 4, seqlen_k=seqlen_k, keys=keys,
                          heads_kv=heads_kv)
    grid = (heads_kv * TILE_RUN, -(-keys // (KEYS_PER_CTA * TILE_RUN)), batch)
    _launcher(spec, device, 0)(grid, THREADS, stream, 0, *args)


def transpose_v_varlen(v: Any, cu_seqlens_k: Any, vt: Any, max_seqlen_k: int, device: int,
                       stream: int) -> None:
    """Packed V (total_k, heads_kv, head_dim) e4m3 and its int32 (batch + 1,) key offsets -> ``vt``
    (1, heads_kv, head_dim, ``fp8_layout.packed_vt_keys``) uint8, contiguous: each sequence's keys
    from ``fp8_layout.sequence_vt_start``, zeros up to the next's (``kernels.fp8_prep``'s varlen
    build). ``max_seqlen_k`` sizes the grid only: the CTAs loop over longer sequences' keys."""
    from ..kernels import params
    from ..kernels.fp8_prep import KEYS_PER_CTA, THREADS, TILE_RUN

    _, heads_kv, head_dim = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    config = configs.FP8_DEFAULTS[head_dim]
    spec = kernel_spec("sm90", "fp8_v", config, "float16", "sm_90a", varlen=True)
    keys = vt.shape[3]
    ss, sh, _ = v.stride()
    args = params.ordered(params.FP8_V_VARLEN, v=(v.data_ptr(), _word_span(v)),
                          vt=(vt.data_ptr(), vt.numel() // 4),
                          cu_seqlens_k=(cu_seqlens_k.data_ptr(), batch + 1), v_ss=ss // 4, v_sh=sh // 4,
                          keys=keys, heads_kv=heads_kv)
    runs = -(-(padded_keys(max_seqlen_k) + 2 * KEY_GROUP) // (KEYS_PER_CTA * TILE_RUN))
    grid = (heads_kv * TILE_RUN, min(runs, 65535), batch)
    _launcher(spec, device, 0)(grid, THREADS, stream, 0, *args)


def _span(x: Any) -> int:
    """Elements from a tensor's first element to its last, inclusive (its array's extent)."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) + 1


def _word_span(x: Any) -> int:
    """4-byte words covering an e4m3 tensor's extent."""
    return (_span(x) + 3) // 4


# A packed call's extra launch values: the offsets (int32 tensors), the sequences, max_seqlen_q and
# the (total_q, heads_q, head_dim) output the threads store into.
Packed = namedtuple("Packed", ["cu_seqlens_q", "cu_seqlens_k", "batch", "max_seqlen_q", "out"])


def _launch(q, k, vt, out, lse, opts: Options, var, write_lse: bool, device: int, stream: int, heads_kv: int,
            seqlen_k: int, packed: Packed | None = None) -> None:
    """Encode the four tensor maps and launch the e4m3 kernel on ``stream``. q, k, out: 4-D
    (packed: (1, total, heads, head_dim) views); ``seqlen_k``: the keys (packed: the maximum)."""
    from ..kernels import params
    from ..kernels.families import kernel_params
    from ..runtime.map_slots import map_slots
    from ..runtime.tensor_map import encode_tensor_map

    gpu = gpu_state.GPU
    config = configs.FP8_DEFAULTS[q.shape[3]]
    sink = opts.sink
    spec = kernel_spec("sm90", "forward", config, opts.out_name, "sm_90a", causal=var.causal,
                       window=var.window, softcap=var.softcap, sink=sink is not None,
                       varlen=packed is not None)
    launcher = _launcher(spec, device, config.shared_bytes)
    batch, seqlen_q, heads_q, head_dim = q.shape
    if packed is not None:
        batch, seqlen_q = packed.batch, packed.max_seqlen_q
    out_map = "bf16" if opts.out_name == "bfloat16" else "f16"
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
    grid = (max(1, min(tiles, gpu.sm_count(device))), 1, 1)
    descales = opts.descales
    span = {"q_descale": descales[0], "k_descale": descales[1], "v_descale": descales[2]}
    values = dict(lse=(lse.data_ptr(), lse.numel()), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  row_lead=0 if packed is not None else config.first_block_lead(seqlen_q), heads_q=heads_q,
                  group=heads_q // heads_kv, batch_size=batch, scale_log2=var.scale_log2, write_lse=write_lse,
                  window_left=var.window_left, window_right=var.window_right, cap_scale=var.cap_scale,
                  **{name: (t.data_ptr(), t.numel()) for name, t in span.items()})
    if packed is not None:
        o = packed.out
        values.update(cu_seqlens_q=(packed.cu_seqlens_q.data_ptr(), batch + 1),
                      cu_seqlens_k=(packed.cu_seqlens_k.data_ptr(), batch + 1), total_q=o.shape[0],
                      o=(o.data_ptr(), _span(o)),
                      o_row_stride=o.stride(0), o_head_stride=o.stride(1))
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


def _numpy_fp8(run, arrays: tuple, lengths: tuple, options: dict):
    """numpy ml_dtypes e4m3 inputs (and, packed, numpy int32 offsets): ``run`` on torch copies on
    the current device, the results back as numpy."""
    try:
        import torch
    except ImportError as error:  # pragma: no cover - torch is how FP8 numpy inputs reach the GPU
        raise NotImplementedError("FP8 numpy inputs need torch (to move them to the GPU)") from error
    if not all(isinstance(x, np.ndarray) for x in arrays):
        raise TypeError("FP8 q, k and v must all be numpy arrays (or all torch tensors)")
    if options["out"] is not None or options["learnable_sink"] is not None:
        raise NotImplementedError("FP8 numpy inputs take no out= or learnable_sink=")

    def to_gpu(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).cuda().view(torch.float8_e4m3fn)

    def descale(x):
        return None if x is None else torch.from_numpy(np.asarray(x, dtype=np.float32)).cuda()

    given = dict(options)
    for name in ("q_descale", "k_descale", "v_descale"):
        given[name] = descale(options[name])
    if lengths:
        cu_q, cu_k, max_q, max_k = lengths
        lengths = (torch.from_numpy(np.ascontiguousarray(cu_q)).cuda(),
                   torch.from_numpy(np.ascontiguousarray(cu_k)).cuda(), max_q, max_k)
    result = run(*(to_gpu(x) for x in arrays), *lengths, **given)
    o, lse = result if options["return_lse"] else (result, None)
    if o.dtype == torch.bfloat16:
        import ml_dtypes

        o_host = o.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    else:
        o_host = o.cpu().numpy()
    return (o_host, lse.cpu().numpy()) if options["return_lse"] else o_host
