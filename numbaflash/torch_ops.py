"""PyTorch integration: ``flash_attention`` as torch custom ops with autograd, fake (meta)
kernels for torch.compile, and the routing that sends a torch call through them.

Imported by ``api.flash_attention`` the first time a torch tensor reaches it (``import
numbaflash`` never imports torch). Two ops under the ``numbaflash`` namespace:

- ``numbaflash::flash_attention_forward(q, k, v, causal, softmax_scale, window_left=-1,
  window_right=-1, softcap=0.0) -> (out, lse)``
- ``numbaflash::flash_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale,
  deterministic, window_left=-1, window_right=-1, softcap=0.0) -> (dq, dk, dv)``

Both return new contiguous tensors (``mutates_args=()``), made by ``torch.empty`` on the
inputs' device, as the eager API does, so they capture in CUDA graphs; their fake kernels give
the same shapes, dtypes and strides and run the eager API's shape and dtype checks, with its
messages. The forward's autograd saves q, k, v, out and lse; the backward is the backward op
(the mma.sync backward kernel on every GPU), deterministic when
``torch.are_deterministic_algorithms_enabled()`` was on at the forward. The LSE is marked
non-differentiable: it does not require grad, and no gradient flows through it. There is no
double backward (the backward op has no autograd formula). A sliding window and a softcap
(issue 35) go through both ops: the forward's are saved and passed to the backward op. Calls
without them pass the ops' original arguments only. The packed variable-length forward op
(``numbaflash::flash_attention_varlen_forward``) has the same kind of autograd: its backward is
``numbaflash::flash_attention_varlen_backward`` (with a fake kernel), which saves the offsets
and maxima with q, k, v, out and lse.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import api
from .operands import Operand, check_flag, check_shapes, check_softcap, check_softmax_scale, check_window_size

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def check_tensors(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The eager API's dtype and shape checks, on metadata only (fake and meta tensors too)."""
    operands = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        dtype_name = _DTYPE_NAMES.get(x.dtype)
        if dtype_name is None:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        operands.append(Operand(name, tuple(x.shape), dtype_name, True, None))
    check_shapes(*operands)


def _check_like(name: str, x: Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, "
                         f"got {tuple(x.shape)} {x.dtype}")


# The ops' implementations on real tensors. Module attributes, looked up at each call, so a
# test can put a reference in their place on the CPU.
def run_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0):
    return api.direct_flash_attention(q, k, v, causal, softmax_scale, True, None, window_size, softcap)


def run_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 softmax_scale: float, deterministic: bool, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0):
    return api.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                        deterministic=deterministic, window_size=window_size, softcap=softcap)


@torch.library.custom_op("numbaflash::flash_attention_forward", mutates_args=())
def flash_attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                            window_left: int = -1, window_right: int = -1,
                            softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q (contiguous), lse float32 (batch, heads_q, seqlen_q). The window
    (``window_left``, ``window_right``; -1 unbounded) and ``softcap`` (0: off) as in
    ``numbaflash.flash_attention``."""
    if window_left == -1 and window_right == -1 and softcap == 0.0:
        out, lse = run_forward(q, k, v, causal, softmax_scale)
    else:
        out, lse = run_forward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap)
    return out, lse


@flash_attention_forward.register_fake
def _forward_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0):
    check_tensors(q, k, v)
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("numbaflash::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             causal: bool, softmax_scale: float, deterministic: bool,
                             window_left: int = -1, window_right: int = -1,
                             softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each like its input (contiguous); the window and softcap as the forward's."""
    if window_left == -1 and window_right == -1 and softcap == 0.0:
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)
    else:
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                                  (window_left, window_right), softcap)
    return dq, dk, dv


@flash_attention_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left=-1,
                   window_right=-1, softcap=0.0):
    check_tensors(q, k, v)
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    _check_like("dout", dout, q.shape, q.dtype)
    _check_like("out", out, q.shape, q.dtype)
    batch, seqlen_q, heads_q, _ = q.shape
    _check_like("lse", lse, (batch, heads_q, seqlen_q), torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale = inputs[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.window_size = (inputs[5], inputs[6]) if len(inputs) > 5 else (-1, -1)
    ctx.softcap = inputs[7] if len(inputs) > 7 else 0.0
    ctx.deterministic = torch.are_deterministic_algorithms_enabled()
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    # The kernel reads dO in 16-byte row chunks: a gradient that is not a plain dense tensor
    # (expanded from a sum, a transposed view, an odd offset) becomes one first.
    if not dout.is_contiguous() or dout.storage_offset() % 8:
        dout = dout.clone(memory_format=torch.contiguous_format)
    if ctx.window_size == (-1, -1) and ctx.softcap == 0.0:
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                              ctx.deterministic)
    else:
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                              ctx.deterministic, *ctx.window_size, ctx.softcap)
    return dq, dk, dv, None, None, None, None, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


_grad_enabled = torch.is_grad_enabled
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack


def route(q: Tensor, k: Tensor, v: Tensor, causal, softmax_scale, return_lse, out, window_size=(-1, -1),
          softcap=0.0):
    """``flash_attention`` on torch tensors: None when the direct (eager, no autograd) path
    serves the call, else its result through the custom op. The op runs when autograd needs
    it (grad mode on and q, k or v requiring grad), under torch.compile / torch.export, on
    tensor subclasses (fake, functional), under a dispatch mode (FakeTensorMode, make_fx,
    FlopCounterMode), and on meta tensors. Kept small: torch.compile traces it
    (``is_dynamo_compiling()`` is constant True there: the rest of the test is not traced;
    non-strict export and make_fx trace with fake tensors under a dispatch mode)."""
    needs_grad = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not (_dynamo_compiling() or needs_grad or type(q) is not Tensor or q.is_meta or _dispatch_modes()):
        return None
    check_tensors(q, k, v)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    softmax_scale = check_softmax_scale(softmax_scale, q.shape[-1])
    if type(softcap) is not float or softcap != 0.0 or window_size != (-1, -1):  # (not traced when default)
        window_size = check_window_size(window_size)
        softcap = check_softcap(softcap, softmax_scale)
    if out is not None:
        if needs_grad:
            raise RuntimeError(
                "flash_attention(): out= does not support automatic differentiation, but q, k or v "
                "requires grad; call it without out= (or under torch.no_grad())")
        if not isinstance(out, Tensor):
            raise TypeError("out must live where the inputs live (numpy for numpy inputs, device otherwise)")
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape {tuple(q.shape)} and dtype "
                             f"{_DTYPE_NAMES.get(q.dtype, q.dtype)}, got {tuple(out.shape)} "
                             f"{_DTYPE_NAMES.get(out.dtype, out.dtype)}")
    if window_size == (-1, -1) and softcap == 0.0:
        result, lse = flash_attention_forward(q, k, v, causal, softmax_scale)
    else:
        result, lse = flash_attention_forward(q, k, v, causal, softmax_scale, *window_size, softcap)
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_lse else result


# ------------------------------------------------------------------ decode


def run_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, k_new: Tensor | None,
                v_new: Tensor | None, block_table: Tensor | None, causal: bool, softmax_scale: float,
                num_splits: int, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0):
    return api.direct_flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                   block_table, causal, softmax_scale, num_splits, True, None,
                                                   window_size, softcap)


@torch.library.custom_op("numbaflash::flash_attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def flash_attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                                 k_new: Tensor | None, v_new: Tensor | None, block_table: Tensor | None,
                                 causal: bool, softmax_scale: float, num_splits: int, window_left: int = -1,
                                 window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """(out, lse) of decode against the cache; k_new / v_new, when given, are written into the
    cache in place (hence ``mutates_args``). The window's sides and the softcap as
    ``flash_attention_with_kvcache`` takes them (validated), passed on only when not the defaults."""
    if window_left == -1 and window_right == -1 and softcap == 0.0:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits)
    else:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits, (window_left, window_right), softcap)
    return out, lse


@flash_attention_with_kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale,
                  num_splits, window_left=-1, window_right=-1, softcap=0.0):
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def route_kvcache(q: Tensor, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                  softmax_scale, num_splits, return_lse, out, window_size=(-1, -1), softcap=0.0):
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
    if window_size == (-1, -1) and softcap == 0.0:
        result, lse = flash_attention_with_kvcache(*args)
    else:
        result, lse = flash_attention_with_kvcache(*args, *window_size, softcap)
    return (result, lse) if return_lse else result


# ------------------------------------------------------------------ packed variable-length forward


def run_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: float, window_size: tuple[int, int],
               softcap: float):
    from .operations.varlen import direct_flash_attention_varlen

    return direct_flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         causal,
                                         softmax_scale, window_size, softcap, True, None)


@torch.library.custom_op("numbaflash::flash_attention_varlen_forward", mutates_args=())
def flash_attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                   cu_seqlens_k: Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                                   window_left: int = -1, window_right: int = -1,
                                   softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q (total_q, heads_q, head_dim), contiguous; lse float32 (heads_q,
    total_q). Autograd: the varlen backward op."""
    out, lse = run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale,
                          (window_left, window_right), softcap)
    return out, lse


@flash_attention_varlen_forward.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 window_left=-1, window_right=-1, softcap=0.0):
    from .operations.varlen import check_offsets_shape, check_packed_shapes, packed

    operands = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        dtype_name = _DTYPE_NAMES.get(x.dtype)
        if dtype_name is None:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        operands.append(Operand(name, tuple(x.shape), dtype_name, True, None))
    check_packed_shapes(*operands)
    check_shapes(*(packed(op) for op in operands))
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        check_offsets_shape(name, tuple(cu.shape), "int32")
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    total_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((heads_q, total_q), dtype=torch.float32)


def run_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        causal: bool, softmax_scale: float, deterministic: bool, window_size: tuple[int, int],
                        softcap: float):
    from .operations.varlen_backward import direct_flash_attention_varlen_backward

    return direct_flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                                  window_size, softcap, deterministic)


@torch.library.custom_op("numbaflash::flash_attention_varlen_backward", mutates_args=())
def flash_attention_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                                    max_seqlen_k: int, causal: bool, softmax_scale: float,
                                    deterministic: bool, window_left: int = -1, window_right: int = -1,
                                    softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the packed variable-length attention, each like its input (contiguous)."""
    dq, dk, dv = run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, softmax_scale, deterministic,
                                     (window_left, window_right), softcap)
    return dq, dk, dv


@flash_attention_varlen_backward.register_fake
def _varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0):
    _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 window_left, window_right, softcap)
    _check_like("dout", dout, q.shape, q.dtype)
    _check_like("out", out, q.shape, q.dtype)
    total_q, heads_q, _ = q.shape
    _check_like("lse", lse, (heads_q, total_q), torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale = inputs[:9]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.window_size = (inputs[9], inputs[10]) if len(inputs) > 10 else (-1, -1)
    ctx.softcap = inputs[11] if len(inputs) > 11 else 0.0
    ctx.deterministic = torch.are_deterministic_algorithms_enabled()
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if not dout.is_contiguous() or dout.storage_offset() % 8:  # 16-byte row chunks (as the dense op's)
        dout = dout.clone(memory_format=torch.contiguous_format)
    dq, dk, dv = flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                 ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.causal,
                                                 ctx.softmax_scale, ctx.deterministic, *ctx.window_size,
                                                 ctx.softcap)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


flash_attention_varlen_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def route_varlen(q: Tensor, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 softmax_scale,
                 window_size, softcap, return_lse, out):
    """``flash_attention_varlen`` on torch tensors: None where the direct path serves the call;
    else the custom op, whose autograd runs the varlen backward (grad mode on and q, k or v
    requiring grad; torch.compile / export, fake or meta tensors, a dispatch mode)."""
    needs_grad = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
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
    result, lse = flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                 int(max_seqlen_k), causal, softmax_scale, *window_size,
                                                     softcap)
    return (result, lse) if return_lse else result
