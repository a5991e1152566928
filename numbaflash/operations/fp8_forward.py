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

import contextlib
import math
import sys
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import configs
from ..kernels.fp8_layout import KEY_GROUP, packed_vt_keys, padded_keys
from ..kernels.spec import kernel_spec
from ..operands import torch_stream
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


def _all_e4m3_tensors(q: Any, k: Any, v: Any) -> bool:
    """q, k, v all torch tensors of dtype float8_e4m3fn (the common case, checked in a few attribute
    reads; anything else goes through ``check_dtypes``)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(q, torch.Tensor):
        return False
    e4m3 = torch.float8_e4m3fn
    return q.dtype == e4m3 and getattr(k, "dtype", None) == e4m3 and getattr(v, "dtype", None) == e4m3


def _check_gpu(capability: tuple[int, int]) -> None:
    if tuple(capability) < (8, 9):
        raise RuntimeError(f"FP8 attention needs FP8 tensor cores (sm_89 or newer); this GPU is sm_"
                           f"{capability[0]}{capability[1]}")


def refuse_grad(torch, q: Any, k: Any, v: Any) -> None:
    """NotImplementedError where grad mode is on and q, k or v requires grad: the FP8 forward has no
    backward."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("the FP8 forward has no backward: call it under torch.no_grad(), or on "
                                  "tensors that do not require grad")


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


def _check_descale_device(x: Any, name: str, device: Any) -> None:
    """A given descale is on q's device."""
    if x is not None and x.device != device:
        raise ValueError(f"{name} must be on {device}, with q, got {x.device}")


Options = namedtuple("Options", ["out_name", "scale", "softcap", "window", "descales", "sink"])
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _options(torch, q: Any, k: Any, v: Any, pairs: tuple[int, int], options: dict) -> Options:
    """The checks the dense and packed FP8 calls share, before anything launches: output dtype,
    scale, softcap, window, descales of shape ``pairs`` = (batch, heads_kv), then q, k, v on one
    CUDA device, then the sink. ``Options.descales``: which descales were given."""
    heads_q, head_dim = q.shape[-2], q.shape[-1]
    out_dtype, softmax_scale, softcap = options["out_dtype"], options["softmax_scale"], options["softcap"]
    window_size, learnable_sink = options["window_size"], options["learnable_sink"]
    descales = _descales_of(options)
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
    for name, x in named:
        _check_descale_device(x, name, device)
    sink = None
    if learnable_sink is not None:
        if (not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dtype != torch.float32
                or tuple(learnable_sink.shape) != (heads_q,) or learnable_sink.device != device):
            raise ValueError(f"learnable_sink must be a float32 ({heads_q},) tensor on {device}")
        sink = learnable_sink.contiguous()
    return Options(out_name, scale, softcap, (left, right), tuple(x is not None for x in descales), sink)


def _check_torch_inputs(torch, q: Any, k: Any, v: Any, dims: int, shape_names: str) -> None:
    """All torch tensors, none needing grad, of ``dims`` dimensions, k and v alike, a head dim with
    a kernel, heads_q a multiple of heads_kv, TMA's layout."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        raise TypeError("FP8 q, k and v must all be torch tensors (or all numpy arrays), got "
                        f"{[type(x).__name__ for x in (q, k, v)]}")
    refuse_grad(torch, q, k, v)
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


def fp8_attention(q: Any, k: Any, v: Any, lengths: tuple | None, options: dict) -> Any:
    """The e4m3 forward of ``flash_attention`` (``lengths`` None: q (batch, seqlen_q, heads_q,
    head_dim)) or of ``flash_attention_varlen`` (``lengths`` = (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k): q (total_q, heads_q, head_dim), descales one row per sequence);
    ``options``: the call's keyword arguments (q_descale, k_descale, v_descale, causal,
    softmax_scale, window_size, softcap, return_lse, out, learnable_sink, out_dtype). numpy inputs
    (and, packed, numpy offsets) run through torch and come back as numpy arrays."""
    if not _all_e4m3_tensors(q, k, v):
        check_dtypes(q, k, v)
    if isinstance(q, np.ndarray) or isinstance(k, np.ndarray) or isinstance(v, np.ndarray):
        if lengths is not None:
            from .varlen import check_sequences

            if not all(isinstance(x, np.ndarray) for x in (q, k, v)) or any(x.ndim != 3 for x in (q, k, v)):
                raise ValueError("FP8 numpy q, k and v must all be 3-D numpy arrays (total, heads, head_dim)")
            check_sequences(*lengths, q.shape[0], k.shape[0], False)
        return _numpy_fp8((q, k, v), lengths, options)
    import torch

    tensors, scalars = (q, k, v), ()
    if lengths is not None:
        tensors, scalars = (q, k, v, lengths[0], lengths[1]), (lengths[2], lengths[3])
    key = _plan_key(torch, tensors, scalars, options)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an option that is not hashable: the checks say what is wrong with it
        key = plan = None
    if plan is None:
        if lengths is None:
            plan = _dense_plan(torch, q, k, v, options)
        else:
            plan = _packed_plan(torch, q, k, v, lengths, options)
        _keep(key, plan)
    if lengths is None:
        return _run(torch, plan, q, k, v, None, None, options)
    return _run(torch, plan, q, k, v, lengths[0], lengths[1], options)


def _dense_plan(torch, q: Any, k: Any, v: Any, options: dict) -> Plan:
    """Every check of a dense call (nothing launched), then its bound launches."""
    _check_torch_inputs(torch, q, k, v, 4, "batch, seqlen, heads, head_dim")
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if max(batch, heads_kv) > 65535 or seqlen_q >= 2**31 or seqlen_k > MAX_SEQLEN_K:
        raise ValueError("FP8 attention takes batch and heads_kv up to 65535, seqlen_q under 2^31 and "
                         f"seqlen_k up to {MAX_SEQLEN_K} (the V prep's grid), got batch {batch}, "
                         f"heads_kv {heads_kv}, seqlens {seqlen_q}, {seqlen_k}")
    opts = _options(torch, q, k, v, (batch, heads_kv), options)
    device = q.device
    out = _check_out(torch, options["out"], tuple(q.shape), getattr(torch, opts.out_name), device)
    var = variant_of(options["causal"], opts.window, opts.softcap, opts.scale, seqlen_q, seqlen_k)
    vt_shape = (batch, heads_kv, head_dim, padded_keys(seqlen_k))
    lse_shape = (batch, heads_q, seqlen_q) if options["return_lse"] else (1,)
    return _build_plan(torch, q, k, v, out, vt_shape, lse_shape, opts, var, options["return_lse"], seqlen_k,
                       _descales_of(options))


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


def _packed_plan(torch, q: Any, k: Any, v: Any, lengths: tuple, options: dict) -> Plan:
    """Every check of a packed call (nothing launched), then its bound launches."""
    from .varlen import check_max_seqlen

    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = lengths
    _check_torch_inputs(torch, q, k, v, 3, "total, heads, head_dim")
    total_q, heads_q, head_dim = q.shape
    total_k, heads_kv, _ = k.shape
    batch = _check_offsets(torch, cu_seqlens_q, cu_seqlens_k, q.device)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if max(batch, heads_kv) > 65535 or max(total_q, total_k) >= 2**31 - packed_vt_keys(0, 65536):
        raise ValueError("packed FP8 attention takes up to 65535 sequences and KV heads and totals under "
                         f"2^31 - 2^21, got batch {batch}, heads_kv {heads_kv}, totals {total_q}, {total_k}")
    opts = _options(torch, q, k, v, (batch, heads_kv), options)
    out = _check_out(torch, options["out"], tuple(q.shape), getattr(torch, opts.out_name), q.device)
    var = variant_of(options["causal"], opts.window, opts.softcap, opts.scale, max_q, max_k)
    vt_shape = (1, heads_kv, head_dim, packed_vt_keys(total_k, batch))
    lse_shape = (heads_q, total_q) if options["return_lse"] else (1,)
    return _build_plan(torch, q[None], k[None], v, out[None], vt_shape, lse_shape, opts, var,
                       options["return_lse"], max_k, _descales_of(options), packed=(batch, max_q, out))


# ------------------------------------------------------------------------------ launch plans
#
# A call's checks and everything its two launches need but the memory (grids, parameter buffers,
# tensor-map layouts, the kernels) are worked out once per layout and kept (``_PLANS``), keyed by
# what the checks read: shapes, strides, dtypes and devices of every tensor, the options. A later
# call of that layout checks only what its memory may change (base alignment, out's overlap with
# the inputs, grad mode) and fires the two bound launches.

# device (torch's), the outputs' shapes, a 1-element tensor of each dtype to make them from (new_empty),
# the 1-element LSE placeholder of calls with no LSE, the bound launches, float32 ones (None where every
# descale is given) and which given descales need a contiguous copy, the layout (packed or dense).
Plan = namedtuple("Plan", ["device", "out_shape", "lse_shape", "vt_shape", "out_template", "lse_template",
                           "vt_template", "prep", "forward", "ones", "copy_descales", "packed"])
_PLANS: dict[tuple, Plan] = {}
PLANS_KEPT = 1024


@contextlib.contextmanager
def mma_kernel_forced() -> Iterator[None]:
    """Within the block, FP8 calls on Hopper run the mma.sync e4m3 kernel (``configs.FP8_MMA_DEFAULTS``,
    the kernel of every other FP8 GPU, where this changes nothing), and the launch plans kept so far
    are set aside (a plan keys the layout, not the config). Not thread-safe: for tests and tools."""
    saved, plans = dict(configs.FP8_DEFAULTS), dict(_PLANS)
    configs.FP8_DEFAULTS.update(configs.FP8_MMA_DEFAULTS)
    _PLANS.clear()
    try:
        yield
    finally:
        configs.FP8_DEFAULTS.update(saved)
        _PLANS.clear()
        _PLANS.update(plans)


def _meta(torch, x: Any) -> tuple | None:
    """What the checks read of an optional tensor argument; raises TypeError for other objects."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError
    return (x.shape, x.stride(), x.dtype, x.device)


def _plan_key(torch, tensors: tuple, scalars: tuple, options: dict) -> tuple | None:
    """The plan key of a call: shapes, strides, dtypes and devices of every tensor, the options
    (None where an argument that should be a tensor is not: the call then takes the checks'
    path, which says what is wrong; an unhashable option fails the lookup the same way). q, k, v
    are e4m3 tensors here or fail the checks."""
    try:
        return (scalars, *(_meta(torch, x) for x in tensors), _meta(torch, options["q_descale"]),
                _meta(torch, options["k_descale"]), _meta(torch, options["v_descale"]),
                _meta(torch, options["out"]), _meta(torch, options["learnable_sink"]), options["causal"],
                options["softmax_scale"], tuple(options["window_size"]), options["softcap"],
                options["return_lse"], options["out_dtype"])
    except TypeError:
        return None


def _keep(key: tuple | None, plan: Plan) -> None:
    if key is None:
        return
    if len(_PLANS) >= PLANS_KEPT:
        _PLANS.clear()  # a miss costs the checks again, never a wrong launch
    _PLANS[key] = plan


def _descales_of(options: dict) -> tuple:
    return tuple(options[name] for name in DESCALE_NAMES)


def _build_plan(torch, q, k, v, out, vt_shape: tuple, lse_shape: tuple, opts: Options, var, write_lse: bool,
                seqlen_k: int, descales: tuple, packed: tuple | None = None) -> Plan:
    """The bound V prep and forward of a checked call: q, k, out 4-D (packed: (1, total, heads,
    head_dim) views; v as given); ``seqlen_k`` the keys (packed: the maximum); ``descales``: as
    given; ``packed``: (batch, max_seqlen_q, the 3-D out)."""
    from ..kernels import params
    from ..kernels.families import family_of, kernel_params
    from ..kernels.fp8_prep import THREADS as PREP_THREADS
    from ..runtime.map_slots import map_slots
    from ..runtime.tensor_map import encode_tensor_map
    from .launch_forward import map_layout_id

    device = q.device
    with torch.cuda.device(device):
        capability, ordinal = gpu_state.GPU.current()
        _check_gpu(capability)
    gpu = gpu_state.GPU
    head_dim = q.shape[3]
    config = configs.fp8_config(capability, head_dim)
    heads_kv = k.shape[2]
    batch, seqlen_q, heads_q, _ = q.shape
    if packed is not None:
        batch, seqlen_q, flat_out = packed
    mma = family_of(config).name == "sm80"  # the mma.sync build (else the Hopper one)
    if mma:  # it reads whole tiles of the transposed V
        if packed is not None:
            raise NotImplementedError("packed (varlen) FP8 attention runs on the Hopper kernel (sm_90) only, "
                                      f"not on the mma.sync one this GPU (sm_{capability[0]}{capability[1]}) "
                                      "runs")
        vt_shape = (*vt_shape[:3], -(-seqlen_k // config.block_n) * config.block_n)
    prep_spec, prep_grid, prep_args = _prep_launch(v, vt_shape, batch, seqlen_k, config, capability)  # V prep
    prep = _launcher(prep_spec, ordinal, 0).bind(prep_grid, PREP_THREADS, 0, *prep_args)
    if mma:
        forward = _mma_forward(q, k, out, vt_shape, lse_shape, opts, var, write_lse, config, capability,
                               ordinal)
        return _plan(torch, device, out.shape, vt_shape, lse_shape, opts, descales, prep, forward,
                     batch * heads_kv, False)
    # the forward
    spec = kernel_spec("sm90", "forward", config, opts.out_name, "sm_90a", causal=var.causal,
                       window=var.window, softcap=var.softcap, sink=opts.sink is not None,
                       varlen=packed is not None)
    launcher = _launcher(spec, ordinal, config.shared_bytes)
    out_map = "bf16" if opts.out_name == "bfloat16" else "f16"
    vt_strides = tuple(int(np.prod(vt_shape[i + 1:])) for i in range(4))
    swizzle = f"{config.row_bytes}B"
    layouts = (
        (tuple(q.shape), tuple(q.stride()), (1, config.block_m, 1, config.box_cols), swizzle, "u8"),
        (tuple(k.shape), tuple(k.stride()), (1, config.block_n, 1, config.box_cols), swizzle, "u8"),
        (vt_shape, vt_strides, (1, 1, head_dim, config.vt_row_bytes), f"{config.vt_row_bytes}B", "u8"),
        (tuple(out.shape), tuple(2 * s for s in out.stride()), (1, 64, 1, config.o_box_cols),
         f"{config.o_row_bytes}B", out_map),
    )

    def encode(*pointers: int):
        return np.stack([encode_tensor_map(pointer, shape, _byte_strides(shape, strides), box, swizzle=sw,
                                           dtype=dtype)
                         for pointer, (shape, strides, box, sw, dtype) in zip(pointers, layouts,
                                                                                strict=True)])

    tiles = -(-seqlen_q // config.block_m) * heads_q * batch
    grid = (max(1, min(tiles, gpu.sm_count(ordinal))), 1, 1)
    pairs = batch * heads_kv
    values = dict(lse=(0, int(np.prod(lse_shape))), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  row_lead=0 if packed is not None else config.first_block_lead(seqlen_q), heads_q=heads_q,
                  group=heads_q // heads_kv, batch_size=batch, scale_log2=var.scale_log2, write_lse=write_lse,
                  window_left=var.window_left, window_right=var.window_right, cap_scale=var.cap_scale,
                  q_descale=(0, pairs), k_descale=(0, pairs), v_descale=(0, pairs))
    if packed is not None:
        values.update(cu_seqlens_q=(0, batch + 1), cu_seqlens_k=(0, batch + 1), total_q=flat_out.shape[0],
                      o=(0, _span(flat_out)), o_row_stride=flat_out.stride(0),
                      o_head_stride=flat_out.stride(1))
    if opts.sink is not None:
        values["sink"] = (0, heads_q)
    args = params.ordered(kernel_params(spec), map_q=(0, 16), map_k=(0, 16), map_v=(0, 16), map_o=(0, 16),
                          **values)
    bound = launcher.bind(grid, config.threads, config.shared_bytes, *args)
    slots = map_slots(ordinal)
    lock, address, used = slots.lock, slots.address, slots.used
    layout = map_layout_id(("fp8", config, layouts))  # the config fixes the boxes

    def forward(stream: int, q: int, k: int, vt: int, o: int, *rest: int) -> None:
        with lock:
            maps, slot = address((layout, q, k, vt, o), lambda: encode(q, k, vt, o), stream)
            try:
                bound(stream, maps, maps + 128, maps + 256, maps + 384, *rest)
            finally:  # even after a failed launch: the slot's copy is on the stream
                used(slot, stream)

    out_shape = flat_out.shape if packed is not None else out.shape
    return _plan(torch, device, out_shape, vt_shape, lse_shape, opts, descales, prep, forward, pairs,
                 packed is not None)


def _plan(torch, device: Any, out_shape: tuple, vt_shape: tuple, lse_shape: tuple, opts: Options,
          descales: tuple, prep: Any, forward: Any, pairs: int, packed: bool) -> Plan:
    """The Plan of a call's bound launches; ``pairs``: the descales' (batch, heads_kv) elements."""
    ones = None if all(opts.descales) else torch.ones(pairs, dtype=torch.float32, device=device)
    copy = tuple(x is not None and not x.is_contiguous() for x in descales)
    return Plan(device, tuple(out_shape), lse_shape, vt_shape,
                torch.empty(1, dtype=getattr(torch, opts.out_name), device=device),
                torch.empty(1, dtype=torch.float32, device=device),
                torch.empty(1, dtype=torch.uint8, device=device),
                prep, forward, ones, copy, packed)


def _mma_forward(q: Any, k: Any, out: Any, vt_shape: tuple, lse_shape: tuple, opts: Options, var,
                 write_lse: bool, config: Any, capability: tuple[int, int], ordinal: int):
    """The bound e4m3 mma.sync forward (``ForwardConfig.fp8``) of a dense call:
    ``forward(stream, q, k, vt, o, lse, q_descale, k_descale, v_descale[, sink])`` (pointers). q and k
    are read as 16-bit words (their byte strides halved: 16-byte multiples, checked), the transposed
    V (``vt_shape``, contiguous, keys padded to whole tiles) likewise."""
    from ..kernels import params
    from ..kernels.families import kernel_params
    from ..runtime.compiler import arch_of
    from .launch_forward import forward_grid

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    keys = vt_shape[3]
    spec = kernel_spec("sm80", "forward", config, opts.out_name, arch_of(capability), causal=var.causal,
                       window=var.window, softcap=var.softcap, sink=opts.sink is not None)
    launcher = _launcher(spec, ordinal, config.shared_bytes)
    half = tuple(s // 2 for s in q.stride()[:3]), tuple(s // 2 for s in k.stride()[:3])
    vt = (heads_kv * head_dim * keys // 2, keys // 2, head_dim * keys // 2)  # batch, row, head
    pairs = batch * heads_kv
    values = dict(q=(0, (_span(q) + 1) // 2), k=(0, (_span(k) + 1) // 2), v=(0, int(np.prod(vt_shape)) // 2),
                  o=(0, _span(out)), lse=(0, int(np.prod(lse_shape))), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  batch_size=batch, heads_q=heads_q, group=heads_q // heads_kv, scale_log2=var.scale_log2,
                  write_lse=write_lse, window_left=var.window_left, window_right=var.window_right,
                  cap_scale=var.cap_scale, q_descale=(0, pairs), k_descale=(0, pairs), v_descale=(0, pairs))
    for name, strides in (("q", half[0]), ("k", half[1]), ("v", vt), ("o", out.stride()[:3])):
        values.update({f"{name}_sb": strides[0], f"{name}_ss": strides[1], f"{name}_sh": strides[2]})
    if opts.sink is not None:
        values["sink"] = (0, heads_q)
    grid = forward_grid(-(-seqlen_q // config.block_m), heads_q, batch)
    return launcher.bind(grid, config.threads, config.shared_bytes,
                         *params.ordered(kernel_params(spec), **values))


def _run(torch, plan: Plan, q, k, v, cu_seqlens_q, cu_seqlens_k, options: dict):
    """One call on ``plan``: the checks its memory needs, the outputs, the two launches."""
    refuse_grad(torch, q, k, v)
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (qp | kp | vp) % 16:
        raise ValueError("FP8 q, k and v must be 16-byte aligned (TMA)")
    out = options["out"]
    if out is None:
        out = plan.out_template.new_empty(plan.out_shape)
    else:
        if out.data_ptr() % 16:
            raise ValueError("out's data must be 16-byte aligned")
        _check_out_overlap(out, (q, k, v))
    lse = plan.lse_template.new_empty(plan.lse_shape) if options["return_lse"] else plan.lse_template
    vt = plan.vt_template.new_empty(plan.vt_shape)
    vtp, op = vt.data_ptr(), out.data_ptr()
    rest = []
    for name, copy in zip(DESCALE_NAMES, plan.copy_descales, strict=True):
        x = options[name]
        rest.append(plan.ones.data_ptr() if x is None else (x.contiguous() if copy else x).data_ptr())
    sink = options["learnable_sink"]
    if sink is not None:
        rest.append(sink.contiguous().data_ptr())  # (one element apart: contiguous already, or a copy)
    if plan.packed:
        rest = [cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), op, *rest]
    device = plan.device.index
    prep_rest = (cu_seqlens_k.data_ptr(),) if plan.packed else ()

    def launch() -> None:
        stream = torch_stream(device)
        plan.prep(stream, vp, vtp, *prep_rest)
        plan.forward(stream, qp, kp, vtp, op, lse.data_ptr(), *rest)

    if gpu_state.GPU.current()[1] == device:  # (a context current on this thread)
        launch()
    else:
        with torch.cuda.device(device):
            gpu_state.GPU.current()
            launch()
    return (out, lse) if options["return_lse"] else out


def _check_out_overlap(out: Any, inputs: tuple) -> None:
    """out must share no byte with q, k or v (the kernel reads them while it writes out)."""
    start = out.data_ptr()
    end = start + _span(out) * out.element_size()
    for name, x in zip(("q", "k", "v"), inputs, strict=True):
        lo = x.data_ptr()
        if lo < end and start < lo + _span(x) * x.element_size():
            raise ValueError(f"out shares memory with {name}; pass an out that does not overlap q, k or v")


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


def _prep_launch(v: Any, vt_shape: tuple, batch: int, max_seqlen_k: int, config: Any = None,
                 capability: tuple[int, int] = (9, 0)) -> tuple:
    """(spec, grid, arguments) of the V prep (``kernels.fp8_prep``) for V as given (dense: (batch,
    seqlen_k, heads_kv, head_dim); packed: (total_k, heads_kv, head_dim) with ``batch`` sequences,
    the longest at most ``max_seqlen_k``: it sizes the grid only) into a contiguous Vt of
    ``vt_shape``; array arguments as (0, elements): the pointers come at launch."""
    from ..kernels import params
    from ..kernels.families import family_of
    from ..kernels.fp8_prep import KEYS_PER_CTA, TILE_RUN
    from ..runtime.compiler import arch_of

    heads_kv, head_dim = v.shape[-2], v.shape[-1]
    config = config or configs.FP8_DEFAULTS[head_dim]
    family, arch = family_of(config).name, arch_of(tuple(capability))
    keys = vt_shape[3]
    words = (0, int(np.prod(vt_shape)) // 4)
    run = KEYS_PER_CTA * TILE_RUN
    if v.dim() == 3:
        spec = kernel_spec(family, "fp8_v", config, "float16", arch, varlen=True)
        ss, sh, _ = v.stride()
        args = params.ordered(params.FP8_V_VARLEN, v=(0, _word_span(v)), vt=words,
                              cu_seqlens_k=(0, batch + 1), v_ss=ss // 4, v_sh=sh // 4, keys=keys,
                              heads_kv=heads_kv)
        runs = min(-(-(padded_keys(max_seqlen_k) + 2 * KEY_GROUP) // run), 65535)
        return spec, (heads_kv * TILE_RUN, runs, batch), args
    spec = kernel_spec(family, "fp8_v", config, "float16", arch)
    sb, ss, sh, _ = v.stride()
    args = params.ordered(params.FP8_V, v=(0, _word_span(v)), vt=words, v_sb=sb // 4, v_ss=ss // 4,
                          v_sh=sh // 4, seqlen_k=v.shape[1], keys=keys, heads_kv=heads_kv)
    return spec, (heads_kv * TILE_RUN, -(-keys // run), v.shape[0]), args


def transpose_v(v: Any, vt: Any, device: int, stream: int) -> None:
    """V (batch, seqlen_k, heads_kv, head_dim) e4m3, head dim contiguous, 16-byte aligned strides
    -> ``vt`` (batch, heads_kv, head_dim, padded keys) uint8, contiguous: the e4m3 kernel's V
    (``kernels.fp8_prep``: keys in ``fp8_layout`` order, zero past seqlen_k), on ``stream``."""
    from ..kernels.fp8_prep import THREADS

    spec, grid, args = _prep_launch(v, tuple(vt.shape), v.shape[0], v.shape[1])
    _launcher(spec, device, 0).bind(grid, THREADS, 0, *args)(stream, v.data_ptr(), vt.data_ptr())


def transpose_v_varlen(v: Any, cu_seqlens_k: Any, vt: Any, max_seqlen_k: int, device: int,
                       stream: int) -> None:
    """Packed V (total_k, heads_kv, head_dim) e4m3 and its int32 (batch + 1,) key offsets -> ``vt``
    (1, heads_kv, head_dim, ``fp8_layout.packed_vt_keys``) uint8, contiguous: each sequence's keys
    from ``fp8_layout.sequence_vt_start``, zeros up to the next's (``kernels.fp8_prep``'s varlen
    build). ``max_seqlen_k`` sizes the grid only: the CTAs loop over longer sequences' keys."""
    from ..kernels.fp8_prep import THREADS

    spec, grid, args = _prep_launch(v, tuple(vt.shape), cu_seqlens_k.shape[0] - 1, max_seqlen_k)
    _launcher(spec, device, 0).bind(grid, THREADS, 0, *args)(stream, v.data_ptr(), vt.data_ptr(),
                                                             cu_seqlens_k.data_ptr())


def _span(x: Any) -> int:
    """Elements from a tensor's first element to its last, inclusive (its array's extent)."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) + 1


def _word_span(x: Any) -> int:
    """4-byte words covering an e4m3 tensor's extent."""
    return (_span(x) + 3) // 4


def _byte_strides(shape: tuple, strides: tuple) -> list[int]:
    """Byte strides (given already in bytes) with a size-1 dimension's stride made the extent of
    the dimensions inside it (a tensor map never steps it; a 0 or odd one would be refused)."""
    out, inner = [], strides[-1] * shape[-1]
    for n, st in zip(reversed(shape[:-1]), reversed(strides[:-1]), strict=True):
        out.append(st if n > 1 else inner)
        inner = out[-1] * n
    return [*reversed(out), strides[-1]]


def _numpy_fp8(arrays: tuple, lengths: tuple | None, options: dict):
    """numpy ml_dtypes e4m3 inputs (and, packed, numpy int32 offsets): ``fp8_attention`` on torch
    copies on the current device, the results back as numpy."""
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
    if lengths is not None:
        cu_q, cu_k, max_q, max_k = lengths
        lengths = (torch.from_numpy(np.ascontiguousarray(cu_q)).cuda(),
                   torch.from_numpy(np.ascontiguousarray(cu_k)).cuda(), max_q, max_k)
    result = fp8_attention(*(to_gpu(x) for x in arrays), lengths, given)
    o, lse = result if options["return_lse"] else (result, None)
    if o.dtype == torch.bfloat16:
        import ml_dtypes

        o_host = o.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    else:
        o_host = o.cpu().numpy()
    return (o_host, lse.cpu().numpy()) if options["return_lse"] else o_host
