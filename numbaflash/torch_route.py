"""Which torch calls go through the custom ops (``torch_ops``): those that need autograd, run
under torch.compile / torch.export, on tensor subclasses (fake, functional), under a dispatch mode
or on meta tensors. Every other torch call takes the direct path (``operations.entry``).

Imported by ``api`` the first time a torch tensor reaches it (``import numbaflash`` never
imports torch); importing it registers the ops. Each ``route*`` returns None where the direct
path serves the call, else the call's result through the op, after the eager API's checks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .operands import check_flag, check_mla_shapes, check_softcap, check_softmax_scale, check_window_size
from .torch_ops import (
    DTYPE_NAMES,
    EagerAttention,
    EagerVarlenAttention,
    check_tensors,
    flash_attention_forward,
    flash_attention_varlen_forward,
    flash_attention_with_kvcache,
    flash_mla_with_kvcache,
    out_shape,
)

_grad_enabled = torch.is_grad_enabled
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_jit_tracing = torch._C._get_tracing_state


def route(q: Tensor, k: Tensor, v: Tensor, causal, softmax_scale, return_lse, out, window_size=(-1, -1),
          softcap=0.0, learnable_sink=None):
    """``flash_attention`` on torch tensors: None when the direct (eager, no autograd) path
    serves the call, else its result through the custom op. The op runs when autograd needs
    it (grad mode on and q, k or v requiring grad), under torch.compile / torch.export, on
    tensor subclasses (fake, functional), under a dispatch mode (FakeTensorMode, make_fx,
    FlopCounterMode), and on meta tensors. Kept small: torch.compile traces it
    (``is_dynamo_compiling()`` is constant True there: the rest of the test is not traced;
    non-strict export and make_fx trace with fake tensors under a dispatch mode). A learnable
    sink that requires grad needs autograd too (``needs_grad``)."""
    needs_grad = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                      or sink_requires_grad(learnable_sink))
    if not (_dynamo_compiling() or needs_grad or type(q) is not Tensor or q.is_meta or _dispatch_modes()):
        return None
    eager = eager_autograd(q, needs_grad)
    given = (causal, softmax_scale, window_size, softcap)
    if not eager:  # (an eager call's entry runs the same checks on the real tensors)
        check_tensors(q, k, v, value_dim=True)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    softmax_scale = check_softmax_scale(softmax_scale, q.shape[-1])
    if type(softcap) is not float or softcap != 0.0 or window_size != (-1, -1):  # (not traced when default)
        window_size = check_window_size(window_size)
        softcap = check_softcap(softcap, softmax_scale)
    if out is not None:
        if needs_grad:
            raise RuntimeError(
                "flash_attention(): out= does not support automatic differentiation, but q, k, v or "
                "learnable_sink requires grad; call it without out= (or under torch.no_grad())")
        if not isinstance(out, Tensor):
            raise TypeError("out must live where the inputs live (numpy for numpy inputs, device otherwise)")
        if tuple(out.shape) != out_shape(q, v) or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape {tuple(q.shape)} (v's head dim) and dtype "
                             f"{DTYPE_NAMES.get(q.dtype, q.dtype)}, got {tuple(out.shape)} "
                             f"{DTYPE_NAMES.get(out.dtype, out.dtype)}")
    if eager:
        if learnable_sink is None and type(given[2]) is tuple:
            _remember(given, q.shape[-1], v.shape[-1], (causal, softmax_scale, window_size, softcap))
        result, lse = EagerAttention.apply(q, k, v, causal, softmax_scale, *window_size, softcap,
                                           learnable_sink)
    elif learnable_sink is not None:
        result, lse = flash_attention_forward(q, k, v, causal, softmax_scale, *window_size, softcap,
                                              learnable_sink)
    elif window_size == (-1, -1) and softcap == 0.0:
        result, lse = flash_attention_forward(q, k, v, causal, softmax_scale)
    else:
        result, lse = flash_attention_forward(q, k, v, causal, softmax_scale, *window_size, softcap)
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_lse else result


# route's checks of the scalars, kept for ``attention_autograd``: (causal, softmax_scale,
# window_size, softcap as given, q's and v's head dims) -> the checked four
_CHECKED: dict = {}
_CHECKED_KEPT = 64
_apply_eager = torch._C._FunctionBase.__dict__["apply"].__get__(None, EagerAttention)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _remember(given: tuple, head_dim: int, head_dim_v: int, checked: tuple) -> None:
    key = (*given, head_dim, head_dim_v)
    if key in _CHECKED:
        return
    if len(_CHECKED) >= _CHECKED_KEPT:
        _CHECKED.clear()
    _CHECKED[key] = checked


def attention_autograd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None,
                       window_size: tuple[int, int], softcap: float) -> Tensor | None:
    """``flash_attention(q, k, v, causal=, softmax_scale=, window_size=, softcap=)`` for a caller
    that makes the same call layer after layer (the transformers integration in training): the
    eager autograd branch of ``route`` (``torch_ops.EagerAttention``, entered below
    ``autograd.Function.apply``'s Python wrapper, tensors unwrapped as it would) for scalars that
    ``route`` checked before with these head dims, which it keeps. The tensors get the checks
    of every eager call (the forward's ``run_torch``, else the entry). Returns out (batch,
    seqlen_q, heads_q, v's head dim), or None where ``route`` must decide: scalars not seen
    (``window_size`` a tuple), no grad needed, or not an eager autograd call (``eager_autograd``);
    call ``api.flash_attention`` then, which checks and keeps them."""
    checked = _CHECKED.get((causal, softmax_scale, window_size, softcap, q.shape[-1], v.shape[-1]))
    if (checked is None or not (_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            or not eager_autograd(q, True)):
        return None
    causal, softmax_scale, window_size, softcap = checked
    return _apply_eager(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), causal, softmax_scale,
                        window_size[0], window_size[1], softcap, None)[0]


def eager_autograd(q: Tensor, needs_grad: bool) -> bool:
    """Whether a call that needs autograd runs it without the op (``torch_ops.EagerAttention``):
    plain tensors, not meta ones, outside torch.compile (Dynamo traces only the op), dispatch
    modes, torch.func transforms and ``torch.jit.trace``, where the op's registrations (fake
    kernel, functionalization, a node a trace can record) are what works."""
    return (needs_grad and not _dynamo_compiling() and type(q) is Tensor and not q.is_meta
            and not _dispatch_modes() and not _functorch_active() and _jit_tracing() is None)


def sink_requires_grad(learnable_sink) -> bool:
    """Whether a learnable sink (None: no sink) requires grad: its gradient comes from the sink
    backward op (``torch_ops.flash_attention_sink_backward``)."""
    return learnable_sink is not None and bool(getattr(learnable_sink, "requires_grad", False))


def route_kvcache(q: Tensor, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                  softmax_scale, num_splits, return_lse, out, window_size=(-1, -1), softcap=0.0,
                  learnable_sink=None, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                  rotary_sin=None, rotary_interleaved=False):
    """``flash_attention_with_kvcache`` on torch tensors: None where the direct path serves the
    call, else its result through the custom op (under torch.compile / export, fake or meta
    tensors, a dispatch mode), so that a compiled decode step has no graph break."""
    if not (_dynamo_compiling() or type(q) is not Tensor or q.is_meta or _dispatch_modes()):
        return None
    if out is not None:
        raise RuntimeError("flash_attention_with_kvcache(): out= is not supported under torch.compile or a "
                           "dispatch mode; use the returned tensor")
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    softmax_scale = check_softmax_scale(softmax_scale, q.shape[-1])
    if type(softcap) is not float or softcap != 0.0 or window_size != (-1, -1):  # (not traced when default)
        window_size = check_window_size(window_size)
        softcap = check_softcap(softcap, softmax_scale)
    args = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale,
            int(num_splits))
    if rotary_cos is not None or rotary_sin is not None:
        result, lse = flash_attention_with_kvcache(*args, *window_size, softcap, learnable_sink,
                                                   cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                                                   check_flag("rotary_interleaved", rotary_interleaved))
    elif cache_batch_idx is not None or cache_leftpad is not None:
        result, lse = flash_attention_with_kvcache(*args, *window_size, softcap, learnable_sink,
                                                   cache_batch_idx, cache_leftpad)
    elif learnable_sink is not None:
        result, lse = flash_attention_with_kvcache(*args, *window_size, softcap, learnable_sink)
    elif window_size == (-1, -1) and softcap == 0.0:
        result, lse = flash_attention_with_kvcache(*args)
    else:
        result, lse = flash_attention_with_kvcache(*args, *window_size, softcap)
    return (result, lse) if return_lse else result


def route_mla(q: Tensor, kv_cache, cache_seqlens, block_table, head_dim_v, causal, softmax_scale, num_splits,
              return_lse, out):
    """``flash_mla_with_kvcache`` on torch tensors: None where the direct path serves the call, else
    its result through the custom op (under torch.compile / export, fake or meta tensors, a dispatch
    mode), so that a compiled decode step has no graph break."""
    if not (_dynamo_compiling() or type(q) is not Tensor or q.is_meta or _dispatch_modes()):
        return None
    if out is not None:
        raise RuntimeError("flash_mla_with_kvcache(): out= is not supported under torch.compile or a "
                           "dispatch mode; use the returned tensor")
    check_mla_shapes(tuple(q.shape), tuple(kv_cache.shape), str(q.dtype), str(kv_cache.dtype), head_dim_v)
    causal = check_flag("causal", causal)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    result, lse = flash_mla_with_kvcache(q, kv_cache, cache_seqlens, block_table, causal, scale,
                                         int(num_splits))
    return (result, lse) if check_flag("return_lse", return_lse) else result


def route_varlen(q: Tensor, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 softmax_scale,
                 window_size, softcap, return_lse, out, learnable_sink=None):
    """``flash_attention_varlen`` on torch tensors: None where the direct path serves the call;
    else the custom op, whose autograd runs the varlen backward (grad mode on and q, k or v
    requiring grad, or a learnable sink requiring grad; torch.compile / export, fake or meta
    tensors, a dispatch mode)."""
    needs_grad = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                      or sink_requires_grad(learnable_sink))
    if not (_dynamo_compiling() or needs_grad or type(q) is not Tensor or q.is_meta or _dispatch_modes()):
        return None
    if out is not None:
        if needs_grad:
            raise RuntimeError(
                "flash_attention_varlen(): out= does not support automatic differentiation, but q, k or v "
                "requires grad; call it without out= (or under torch.no_grad())")
        raise RuntimeError("flash_attention_varlen(): out= is not supported under torch.compile or a "
                           "dispatch mode; use the returned tensor")
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    softmax_scale = check_softmax_scale(softmax_scale, q.shape[-1])
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap, softmax_scale)
    if eager_autograd(q, needs_grad):
        result, lse = EagerVarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                 int(max_seqlen_k), causal, softmax_scale, *window_size,
                                                 softcap, learnable_sink)
        return (result, lse) if return_lse else result
    sink = () if learnable_sink is None else (learnable_sink,)
    result, lse = flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                 int(max_seqlen_k), causal, softmax_scale, *window_size,
                                                 softcap, *sink)
    return (result, lse) if return_lse else result


def route_fp8(q: Tensor, k, v, lengths: tuple | None, options: dict):
    """An FP8 call (``flash_attention``, or ``flash_attention_varlen`` with ``lengths`` = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)) on torch tensors: None where the direct path serves
    it (plain tensors, eager), else its result through the FP8 op (``torch_ops``): under
    torch.compile / torch.export, on tensor subclasses or meta tensors, under a dispatch mode. The
    FP8 forward has no backward: tensors that require grad (grad mode on) are refused."""
    if not (_dynamo_compiling() or type(q) is not Tensor or q.is_meta or _dispatch_modes()):
        return None
    from .torch_ops import flash_attention_fp8_forward, flash_attention_varlen_fp8_forward

    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("the FP8 forward has no backward: call it under torch.no_grad(), or on "
                                  "tensors that do not require grad")
    causal = check_flag("causal", options["causal"])
    return_lse = check_flag("return_lse", options["return_lse"])
    softmax_scale = check_softmax_scale(options["softmax_scale"], q.shape[-1])
    window = check_window_size(options["window_size"])
    softcap = check_softcap(options["softcap"], softmax_scale)
    out_dtype = torch.bfloat16 if options["out_dtype"] is None else options["out_dtype"]
    scalars = (options["q_descale"], options["k_descale"], options["v_descale"], causal, softmax_scale,
               window[0], window[1], softcap, options["learnable_sink"], out_dtype)
    if lengths is None:
        result, lse = flash_attention_fp8_forward(q, k, v, *scalars)
    else:
        cu_q, cu_k, max_q, max_k = lengths
        result, lse = flash_attention_varlen_fp8_forward(q, k, v, cu_q, cu_k, int(max_q), int(max_k),
                                                         *scalars)
    out = options["out"]
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result
