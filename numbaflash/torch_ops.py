"""PyTorch integration: ``flash_attention`` as torch custom ops with autograd, and fake (meta)
kernels for torch.compile. ``torch_route`` decides which torch calls go through them; the ops
run the checked entries (``operations.entry``, ``operations.varlen*``) on real tensors.

Imported through ``torch_route`` the first time a torch tensor reaches the API (``import
numbaflash`` never imports torch). Two ops under the ``numbaflash`` namespace:

- ``numbaflash::flash_attention_forward(q, k, v, causal, softmax_scale, window_left=-1,
  window_right=-1, softcap=0.0, learnable_sink=None) -> (out, lse)``
- ``numbaflash::flash_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale,
  deterministic, window_left=-1, window_right=-1, softcap=0.0) -> (dq, dk, dv)``
- ``numbaflash::flash_mla_with_kvcache(q, kv_cache, cache_seqlens, block_table, causal,
  softmax_scale, num_splits) -> (out, lse)``: MLA decode (reads the cache only; no autograd);
  ``numbaflash::flash_attention_with_kvcache`` is decode's (it appends in place);
- ``numbaflash::flash_attention_sink_backward(dout, q, k, v, out, lse, learnable_sink, causal,
  softmax_scale, deterministic, window_left, window_right, softcap) -> (dq, dk, dv, d_sink)``:
  the backward of a forward with a learnable sink (its own op, so that the sinkless op's schema
  stays as it was); and its packed twin ``flash_attention_varlen_sink_backward``.

Both return new contiguous tensors (``mutates_args=()``), made by ``torch.empty`` on the
inputs' device, as the eager API does, so they capture in CUDA graphs; their fake kernels give
the same shapes, dtypes and strides and run the eager API's shape and dtype checks, with its
messages. The forward's autograd saves q, k, v, out and lse; the backward is the backward op
(the mma.sync backward kernel on every GPU), deterministic when
``torch.are_deterministic_algorithms_enabled()`` was on at the forward. The LSE is marked
non-differentiable: it does not require grad, and no gradient flows through it. There is no
double backward (the backward op has no autograd formula). A sliding window and a softcap
(issue 35) go through both ops: the forward's are saved and passed to the backward op. Calls
without them pass the ops' original arguments only. A learnable sink (issue 56) goes through
both forward ops as their last argument; the autograd formula of a forward that had one saves it
and runs the sink backward op, whose d_sink (float32 (heads_q,)) is the sink's gradient (the
sink may require grad; q, k, v need not). The packed variable-length forward op
(``numbaflash::flash_attention_varlen_forward``) has the same kind of autograd: its backward is
``numbaflash::flash_attention_varlen_backward`` (with a fake kernel), which saves the offsets
and maxima with q, k, v, out and lse.

Eager calls that need autograd (plain tensors, outside torch.compile, dispatch modes and torch.func)
skip the forward ops' dispatch: ``EagerAttention`` and ``EagerVarlenAttention`` are autograd
Functions that run the same implementations and formulas (``torch_route.eager_autograd`` picks
them), as the formulas call the backward ops' implementations themselves (``eager_formula``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import configs
from .operands import Operand, check_mla_shapes, check_shapes, check_softcap, check_window_size
from .operations import backward as backward_operation
from .operations.entry import (
    direct_flash_attention,
    direct_flash_attention_backward,
    direct_flash_attention_with_kvcache,
    direct_flash_mla_with_kvcache,
)
from .operations.forward import variant_of
from .operations.varlen import check_offsets_shape, check_packed_shapes, direct_flash_attention_varlen, packed
from .operations.varlen_backward import direct_flash_attention_varlen_backward
from .runtime import device as gpu_state

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}

_grad_enabled = torch.is_grad_enabled
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack


def eager_formula(dout: Tensor) -> bool:
    """Whether an autograd formula of ours runs eagerly on real tensors, so that it may call its
    backward op's implementation itself (``run_backward``, ``run_varlen_backward``) instead of the
    op: grad mode off (a double backward keeps the op, which has no autograd formula and says
    so), not under torch.compile (Dynamo; AOTAutograd and compiled autograd trace the formula
    with fake tensors under a dispatch mode), and a plain, non-meta tensor. What the op adds there
    is torch's dispatch alone (its autograd and device kernels, the aliasing check): some tens of
    microseconds a call, as much as the backward's whole host cost."""
    return not (_grad_enabled() or _dynamo_compiling() or _dispatch_modes() or type(dout) is not Tensor
                or dout.is_meta)


def check_tensors(q: Tensor, k: Tensor, v: Tensor, value_dim: bool = False) -> None:
    """The eager API's dtype and shape checks, on metadata only (fake and meta tensors too);
    ``value_dim``: v may have another head dim where a kernel has the pair (the dense ops)."""
    operands = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        dtype_name = DTYPE_NAMES.get(x.dtype)
        if dtype_name is None:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        operands.append(Operand(name, tuple(x.shape), dtype_name, True, None))
    check_shapes(*operands, value_dim=value_dim)


def out_shape(q: Tensor, v: Tensor) -> tuple[int, ...]:
    """The forward's out: q's shape with v's head dim."""
    return (*q.shape[:-1], v.shape[-1])


def _check_like(name: str, x: Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
        raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, "
                         f"got {tuple(x.shape)} {x.dtype}")


# The ops' implementations on real tensors. Module attributes, looked up at each call, so a
# test can put a reference in their place on the CPU.
def run_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                learnable_sink: Tensor | None = None):
    if learnable_sink is None:
        return direct_flash_attention(q, k, v, causal, softmax_scale, True, None, window_size, softcap)
    return direct_flash_attention(q, k, v, causal, softmax_scale, True, None, window_size, softcap,
                                  learnable_sink)


def run_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 softmax_scale: float, deterministic: bool, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, learnable_sink: Tensor | None = None):
    if learnable_sink is None:
        return direct_flash_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                                               None, None, None, window_size, softcap)
    return direct_flash_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                                           None, None, None, window_size, softcap, learnable_sink)


def prepare_backward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     max_seqlens: tuple[int, int] | None = None, learnable_sink: Tensor | None = None) -> int:
    """Before a forward on CUDA tensors of which q, k or v requires grad (its backward will follow:
    eager autograd, and a compiled training graph), start compiling the backward's kernels of the
    call in worker processes (``operations.backward.prepare_backward``), so that they compile
    beside the forward's; returns how many started (0 for everything else). ``max_seqlens``: a
    packed variable-length call's (max_seqlen_q, max_seqlen_k); ``learnable_sink``: a sink call's
    (its prepare kernel is the sink build; the sink alone requiring grad is enough). Never raises
    for a call the forward rejects: the forward then gives the error."""
    sink_grad = learnable_sink is not None and learnable_sink.requires_grad
    if not (q.requires_grad or k.requires_grad or v.requires_grad or sink_grad) or not q.is_cuda:
        return 0
    dtype_name = DTYPE_NAMES.get(q.dtype)
    if dtype_name is None:
        return 0
    seqlen_q, seqlen_k = max_seqlens or (q.shape[1], k.shape[1])
    # once per kind of call (the training loop's every layer makes the same one); not under a
    # forced config, where it starts nothing and must look again once the config is lifted
    seen = (q.get_device(), dtype_name, q.shape[-1], v.shape[-1], seqlen_q, seqlen_k, causal, softmax_scale,
            window_size, softcap, max_seqlens is None, learnable_sink is None)
    if seen in _PREPARED_CALLS:
        return 0
    try:
        capability, device = gpu_state.GPU.current()
        var = variant_of(causal, window_size, softcap, softmax_scale, seqlen_q, seqlen_k)
    except (RuntimeError, ValueError, TypeError):
        return 0
    long = configs.backward_is_long(seqlen_q, varlen=max_seqlens is not None)
    started = backward_operation.prepare_backward(capability, device, q.shape[-1], var.causal,
                                                  dtype_name == "bfloat16", window=var.window,
                                                  softcap=var.softcap, varlen=max_seqlens is not None,
                                                  sink=learnable_sink is not None,
                                                  head_dim_v=0 if v.shape[-1] == q.shape[-1] else v.shape[-1],
                                                  long=long)
    if not configs.OVERRIDES and device == seen[0]:
        if len(_PREPARED_CALLS) >= 256:
            _PREPARED_CALLS.clear()
        _PREPARED_CALLS.add(seen)
    return started


_PREPARED_CALLS: set = set()  # prepare_backward's calls done: (device, dtype, head dims, seqlens, options)


@torch.library.custom_op("numbaflash::flash_attention_forward", mutates_args=())
def flash_attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                            window_left: int = -1, window_right: int = -1,
                            softcap: float = 0.0,
                            learnable_sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q with v's head dim (contiguous), lse float32 (batch, heads_q,
    seqlen_q). The window
    (``window_left``, ``window_right``; -1 unbounded), ``softcap`` (0: off) and ``learnable_sink``
    (float32 (heads_q,), or None) as in ``numbaflash.flash_attention``."""
    return _forward(q, k, v, causal, softmax_scale, window_left, window_right, softcap, learnable_sink)


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, window_left: int,
             window_right: int, softcap: float, learnable_sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """The forward op's implementation (also ``EagerAttention``'s forward)."""
    if learnable_sink is not None:
        prepare_backward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap, None,
                         learnable_sink)
        return run_forward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap,
                           learnable_sink)
    prepare_backward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap)
    if window_left == -1 and window_right == -1 and softcap == 0.0:
        out, lse = run_forward(q, k, v, causal, softmax_scale)
    else:
        out, lse = run_forward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap)
    return out, lse


@flash_attention_forward.register_fake
def _forward_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                  learnable_sink=None):
    check_tensors(q, k, v, value_dim=True)
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    _check_sink(learnable_sink, heads_q)
    return q.new_empty(out_shape(q, v)), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("numbaflash::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             causal: bool, softmax_scale: float, deterministic: bool,
                             window_left: int = -1, window_right: int = -1,
                             softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each like its input (contiguous); the window and softcap as the forward's."""
    return _dense_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                           (window_left, window_right), softcap)


def _dense_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    softmax_scale: float, deterministic: bool, window_size: tuple[int, int],
                    softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """The backward op's implementation (also run by the eager autograd formula, ``_backward``):
    ``run_backward``, with the window and softcap only when not the defaults."""
    if window_size == (-1, -1) and softcap == 0.0:
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)
    else:
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_size,
                                  softcap)
    return dq, dk, dv


@flash_attention_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left=-1,
                   window_right=-1, softcap=0.0):
    check_tensors(q, k, v, value_dim=True)
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    _check_like("dout", dout, out_shape(q, v), q.dtype)
    _check_like("out", out, out_shape(q, v), q.dtype)
    batch, seqlen_q, heads_q, _ = q.shape
    _check_like("lse", lse, (batch, heads_q, seqlen_q), torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("numbaflash::flash_attention_sink_backward", mutates_args=())
def flash_attention_sink_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  learnable_sink: Tensor, causal: bool, softmax_scale: float,
                                  deterministic: bool, window_left: int, window_right: int,
                                  softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_sink) of a forward with a learnable sink: dq, dk, dv like their inputs
    (contiguous), d_sink float32 (heads_q,)."""
    dq, dk, dv, d_sink = run_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                                      (window_left, window_right), softcap, learnable_sink)
    return dq, dk, dv, d_sink


@flash_attention_sink_backward.register_fake
def _sink_backward_fake(dout, q, k, v, out, lse, learnable_sink, causal, softmax_scale, deterministic,
                        window_left, window_right, softcap):
    dq, dk, dv = _backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left,
                                window_right, softcap)
    _check_sink(learnable_sink, q.shape[2])
    return dq, dk, dv, learnable_sink.new_empty(learnable_sink.shape)


def _check_sink(sink: Tensor | None, heads_q: int) -> None:
    """A learnable sink's checks on metadata (fake and meta tensors too): float32 (heads_q,)."""
    if sink is not None:
        _check_like("learnable_sink", sink, (heads_q,), torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale = inputs[:5]
    sink = inputs[8] if len(inputs) > 8 else None
    ctx.has_sink = sink is not None
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *((sink,) if ctx.has_sink else ()))
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.window_size = (inputs[5], inputs[6]) if len(inputs) > 5 else (-1, -1)
    ctx.softcap = inputs[7] if len(inputs) > 7 else 0.0
    ctx.deterministic = torch.are_deterministic_algorithms_enabled()
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    # saved_tensors unpacked once: under non-reentrant activation checkpointing each unpack
    # recomputes, and a second one is an error (torch.utils.checkpoint.CheckpointError)
    saved = ctx.saved_tensors
    q, k, v, out, lse = saved[:5]
    # The kernel reads dO in 16-byte row chunks: a gradient that is not a plain dense tensor
    # (expanded from a sum, a transposed view, an odd offset) becomes one first.
    if not dout.is_contiguous() or dout.storage_offset() % 8:
        dout = dout.clone(memory_format=torch.contiguous_format)
    eager = eager_formula(dout)  # then the ops' implementations, without torch's dispatch
    if ctx.has_sink:
        sink = saved[5]
        if eager:
            dq, dk, dv, d_sink = run_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                              ctx.deterministic, ctx.window_size, ctx.softcap, sink)
        else:
            dq, dk, dv, d_sink = flash_attention_sink_backward(dout, q, k, v, out, lse, sink, ctx.causal,
                                                               ctx.softmax_scale, ctx.deterministic,
                                                               *ctx.window_size, ctx.softcap)
        return dq, dk, dv, None, None, None, None, None, d_sink if ctx.needs_input_grad[8] else None
    if eager:
        dq, dk, dv = _dense_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                     ctx.deterministic, ctx.window_size, ctx.softcap)
    elif ctx.window_size == (-1, -1) and ctx.softcap == 0.0:
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                              ctx.deterministic)
    else:
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                              ctx.deterministic, *ctx.window_size, ctx.softcap)
    return dq, dk, dv, None, None, None, None, None, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """``flash_attention_forward``'s autograd for eager calls (``torch_route.route`` takes it where
    grad is needed on plain tensors, outside torch.compile, dispatch modes and torch.func
    transforms): the op's implementation and formula (``_forward``, ``_setup_context``,
    ``_backward``) without the dispatch of a custom op, whose autograd wrapper is Python (about
    50 microseconds a call on the host: docs/PERFORMANCE.md, "Host cost of training calls"). No
    zero gradient is made for the LSE, which gets none (``set_materialize_grads(False)``).
    Inputs as the op's, all nine positional."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_left, window_right, softcap, learnable_sink):
        # ctx in forward, not a setup_context: with one, Function.apply binds the arguments through
        # inspect.signature on every call (tens of microseconds)
        output = _forward(q, k, v, causal, softmax_scale, window_left, window_right, softcap, learnable_sink)
        _setup_context(ctx, (q, k, v, causal, softmax_scale, window_left, window_right, softcap,
                             learnable_sink), output)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # only the LSE was used: it is not differentiable, nothing flows back
            return (None,) * 9
        return _backward(ctx, dout, dlse)


# ------------------------------------------------------------------ decode


def run_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, k_new: Tensor | None,
                v_new: Tensor | None, block_table: Tensor | None, causal: bool, softmax_scale: float,
                num_splits: int, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                learnable_sink: Tensor | None = None, cache_batch_idx: Tensor | None = None,
                cache_leftpad: Tensor | None = None, rotary_cos: Tensor | None = None,
                rotary_sin: Tensor | None = None, rotary_interleaved: bool = False):
    if cache_batch_idx is not None or cache_leftpad is not None or rotary_cos is not None:
        return direct_flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                   block_table, causal, softmax_scale, num_splits, True, None,
                                                   window_size, softcap, learnable_sink, cache_batch_idx,
                                                   cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved)
    if learnable_sink is None:
        return direct_flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                   block_table, causal, softmax_scale, num_splits, True, None,
                                                   window_size, softcap)
    return direct_flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                               causal, softmax_scale, num_splits, True, None, window_size,
                                               softcap, learnable_sink)


@torch.library.custom_op("numbaflash::flash_attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def flash_attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                                 k_new: Tensor | None, v_new: Tensor | None, block_table: Tensor | None,
                                 causal: bool, softmax_scale: float, num_splits: int, window_left: int = -1,
                                 window_right: int = -1, softcap: float = 0.0,
                                 learnable_sink: Tensor | None = None, cache_batch_idx: Tensor | None = None,
                                 cache_leftpad: Tensor | None = None, rotary_cos: Tensor | None = None,
                                 rotary_sin: Tensor | None = None,
                                 rotary_interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of decode against the cache; k_new / v_new, when given, are written into the
    cache in place (hence ``mutates_args``). The window's sides, the softcap, the learnable sink,
    cache_batch_idx, cache_leftpad and the rotary embedding as ``flash_attention_with_kvcache``
    takes them (validated), passed on only when not the defaults."""
    if rotary_cos is not None or rotary_sin is not None:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits, (window_left, window_right), softcap,
                               learnable_sink, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                               rotary_interleaved)
    elif cache_batch_idx is not None or cache_leftpad is not None:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits, (window_left, window_right), softcap,
                               learnable_sink, cache_batch_idx, cache_leftpad)
    elif learnable_sink is not None:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits, (window_left, window_right), softcap,
                               learnable_sink)
    elif window_left == -1 and window_right == -1 and softcap == 0.0:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits)
    else:
        out, lse = run_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits, (window_left, window_right), softcap)
    return out, lse


@flash_attention_with_kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale,
                  num_splits, window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None,
                  cache_batch_idx=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                  rotary_interleaved=False):
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    _check_sink(learnable_sink, heads_q)
    for name, index in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if index is not None and (index.dtype != torch.int32 or tuple(index.shape) != (batch,)):
            raise ValueError(f"{name} must be an int32 tensor of shape (batch,) = ({batch},), got "
                             f"{index.dtype} of shape {tuple(index.shape)}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and (rotary_cos.dtype != q.dtype or rotary_cos.dim() != 2
                                   or rotary_sin.shape != rotary_cos.shape):
        raise ValueError(f"rotary_cos and rotary_sin must be {q.dtype} tensors of one shape (seqlen_ro, "
                         f"rotary_dim / 2), got {rotary_cos.dtype} {tuple(rotary_cos.shape)} and "
                         f"{rotary_sin.dtype} {tuple(rotary_sin.shape)}")
    # out has v_cache's head dim (a pair of head dims: ``configs.ASYMMETRIC_HEAD_DIMS``)
    return (q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[3])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))


# ------------------------------------------------------------------ packed variable-length forward


def run_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: float, window_size: tuple[int, int],
               softcap: float, learnable_sink: Tensor | None = None):
    return direct_flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         causal,
                                         softmax_scale, window_size, softcap, True, None, learnable_sink)


@torch.library.custom_op("numbaflash::flash_attention_varlen_forward", mutates_args=())
def flash_attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                   cu_seqlens_k: Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                                   window_left: int = -1, window_right: int = -1,
                                   softcap: float = 0.0,
                                   learnable_sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q with v's head dim (total_q, heads_q, head_dim_v), contiguous; lse
    float32 (heads_q, total_q). Autograd: the varlen backward op (the varlen sink backward op with a
    ``learnable_sink``)."""
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           softmax_scale, window_left, window_right, softcap, learnable_sink)


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                    window_left: int, window_right: int, softcap: float,
                    learnable_sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """The packed forward op's implementation (also ``EagerVarlenAttention``'s forward)."""
    if learnable_sink is not None:
        prepare_backward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap,
                         (max_seqlen_q, max_seqlen_k), learnable_sink)
        return run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, (window_left, window_right), softcap, learnable_sink)
    prepare_backward(q, k, v, causal, softmax_scale, (window_left, window_right), softcap,
                     (max_seqlen_q, max_seqlen_k))
    out, lse = run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale,
                          (window_left, window_right), softcap)
    return out, lse


@flash_attention_varlen_forward.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None):
    operands = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        dtype_name = DTYPE_NAMES.get(x.dtype)
        if dtype_name is None:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        operands.append(Operand(name, tuple(x.shape), dtype_name, True, None))
    check_packed_shapes(*operands)
    check_shapes(*(packed(op) for op in operands), value_dim=True)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        check_offsets_shape(name, tuple(cu.shape), "int32")
    check_window_size((window_left, window_right))
    check_softcap(softcap, softmax_scale)
    total_q, heads_q, _ = q.shape
    _check_sink(learnable_sink, heads_q)
    return q.new_empty(out_shape(q, v)), q.new_empty((heads_q, total_q), dtype=torch.float32)


def run_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        causal: bool, softmax_scale: float, deterministic: bool, window_size: tuple[int, int],
                        softcap: float, learnable_sink: Tensor | None = None):
    if learnable_sink is None:
        return direct_flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                      max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                                      window_size, softcap, deterministic)
    return direct_flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                                  window_size, softcap, deterministic, None, None, None,
                                                  learnable_sink)


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
    _check_like("dout", dout, out_shape(q, v), q.dtype)
    _check_like("out", out, out_shape(q, v), q.dtype)
    total_q, heads_q, _ = q.shape
    _check_like("lse", lse, (heads_q, total_q), torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("numbaflash::flash_attention_varlen_sink_backward", mutates_args=())
def flash_attention_varlen_sink_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                         lse: Tensor, learnable_sink: Tensor, cu_seqlens_q: Tensor,
                                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                         causal: bool, softmax_scale: float, deterministic: bool,
                                         window_left: int, window_right: int,
                                         softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_sink) of a packed forward with a learnable sink (d_sink float32 (heads_q,),
    summed over every sequence)."""
    dq, dk, dv, d_sink = run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic,
                                             (window_left, window_right), softcap, learnable_sink)
    return dq, dk, dv, d_sink


@flash_attention_varlen_sink_backward.register_fake
def _varlen_sink_backward_fake(dout, q, k, v, out, lse, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic, window_left,
                               window_right, softcap):
    dq, dk, dv = _varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, causal, softmax_scale, deterministic, window_left,
                                       window_right, softcap)
    _check_sink(learnable_sink, q.shape[1])
    return dq, dk, dv, learnable_sink.new_empty(learnable_sink.shape)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale = inputs[:9]
    out, lse = output
    sink = inputs[12] if len(inputs) > 12 else None
    ctx.has_sink = sink is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *((sink,) if ctx.has_sink else ()))
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.window_size = (inputs[9], inputs[10]) if len(inputs) > 10 else (-1, -1)
    ctx.softcap = inputs[11] if len(inputs) > 11 else 0.0
    ctx.deterministic = torch.are_deterministic_algorithms_enabled()
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    saved = ctx.saved_tensors  # unpacked once (see _backward)
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = saved[:7]
    if not dout.is_contiguous() or dout.storage_offset() % 8:  # 16-byte row chunks (as the dense op's)
        dout = dout.clone(memory_format=torch.contiguous_format)
    eager = eager_formula(dout)  # then the ops' implementations, without torch's dispatch
    if ctx.has_sink:
        sink = saved[7]
        if eager:
            dq, dk, dv, d_sink = run_varlen_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                ctx.causal, ctx.softmax_scale, ctx.deterministic, ctx.window_size, ctx.softcap, sink)
        else:
            dq, dk, dv, d_sink = flash_attention_varlen_sink_backward(
                dout, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                ctx.causal, ctx.softmax_scale, ctx.deterministic, *ctx.window_size, ctx.softcap)
        return (dq, dk, dv, None, None, None, None, None, None, None, None, None,
                d_sink if ctx.needs_input_grad[12] else None)
    if eager:
        dq, dk, dv = run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.causal, ctx.softmax_scale,
                                         ctx.deterministic, ctx.window_size, ctx.softcap)
    else:
        dq, dk, dv = flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                     ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.causal,
                                                     ctx.softmax_scale, ctx.deterministic, *ctx.window_size,
                                                     ctx.softcap)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


flash_attention_varlen_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class EagerVarlenAttention(torch.autograd.Function):
    """``flash_attention_varlen_forward``'s autograd for eager calls, as ``EagerAttention`` is the
    dense op's. Inputs as the op's, all thirteen positional."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                window_left, window_right, softcap, learnable_sink):
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                  window_left, window_right, softcap, learnable_sink)
        output = _varlen_forward(*inputs)
        _varlen_setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # only the LSE was used: it is not differentiable, nothing flows back
            return (None,) * 13
        return _varlen_backward(ctx, dout, dlse)


# ------------------------------------------------------------------------------ FP8 (e4m3) forwards
# No backward: the ops exist so that torch.compile, torch.export and fake-tensor tracing see an FP8
# call as one op (the direct path reads data pointers, which fake tensors do not have).

def _fp8_options(q_descale, k_descale, v_descale, causal, softmax_scale, window_left, window_right, softcap,
                 learnable_sink, out_dtype) -> dict:
    return dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=causal,
                softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
                return_lse=True, out=None, learnable_sink=learnable_sink, out_dtype=out_dtype)


@torch.library.custom_op("numbaflash::flash_attention_fp8_forward", mutates_args=())
def flash_attention_fp8_forward(q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor | None,
                                k_descale: Tensor | None, v_descale: Tensor | None, causal: bool,
                                softmax_scale: float, window_left: int, window_right: int, softcap: float,
                                learnable_sink: Tensor | None,
                                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out, lse) of the e4m3 forward (``numbaflash.flash_attention`` with FP8 inputs): out
    (batch, seqlen_q, heads_q, head_dim) in ``out_dtype``, lse float32 (batch, heads_q, seqlen_q)."""
    from .operations.fp8_forward import fp8_attention

    return fp8_attention(q, k, v, None, _fp8_options(q_descale, k_descale, v_descale, causal, softmax_scale,
                                                     window_left, window_right, softcap, learnable_sink,
                                                     out_dtype))


def _check_fp8_fake(q: Tensor, k: Tensor, v: Tensor, dims: int, out_dtype: torch.dtype) -> None:
    """What the FP8 ops' fake implementations can check of meta data (the real call checks all)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != torch.float8_e4m3fn or x.dim() != dims:
            raise TypeError(f"{name} must be a {dims}-D float8_e4m3fn tensor, got {x.dtype} {tuple(x.shape)}")
    if tuple(k.shape) != tuple(v.shape) or k.shape[-1] != q.shape[-1] or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"FP8 q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         "together")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")


@flash_attention_fp8_forward.register_fake
def _fp8_fake(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, window_left, window_right,
              softcap, learnable_sink, out_dtype):
    _check_fp8_fake(q, k, v, 4, out_dtype)
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("numbaflash::flash_attention_varlen_fp8_forward", mutates_args=())
def flash_attention_varlen_fp8_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                       cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                       q_descale: Tensor | None, k_descale: Tensor | None,
                                       v_descale: Tensor | None, causal: bool, softmax_scale: float,
                                       window_left: int, window_right: int, softcap: float,
                                       learnable_sink: Tensor | None,
                                       out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out, lse) of the packed e4m3 forward (``numbaflash.flash_attention_varlen`` with FP8
    inputs): out (total_q, heads_q, head_dim) in ``out_dtype``, lse float32 (heads_q, total_q)."""
    from .operations.fp8_forward import fp8_attention

    return fp8_attention(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                         _fp8_options(q_descale, k_descale, v_descale, causal, softmax_scale, window_left,
                                      window_right, softcap, learnable_sink, out_dtype))


@flash_attention_varlen_fp8_forward.register_fake
def _varlen_fp8_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale,
                     v_descale, causal, softmax_scale, window_left, window_right, softcap, learnable_sink,
                     out_dtype):
    _check_fp8_fake(q, k, v, 3, out_dtype)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
    total_q, heads_q, _ = q.shape
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty((heads_q, total_q), dtype=torch.float32)


def run_mla(q: Tensor, kv_cache: Tensor, cache_seqlens: Tensor, block_table: Tensor | None, causal: bool,
            softmax_scale: float, num_splits: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of MLA decode on real tensors (``entry.direct_flash_mla_with_kvcache``)."""
    return direct_flash_mla_with_kvcache(q, kv_cache, cache_seqlens, block_table, configs.MLA_HEAD_DIMS[1],
                                         causal, softmax_scale, num_splits, True, None)


@torch.library.custom_op("numbaflash::flash_mla_with_kvcache", mutates_args=())
def flash_mla_with_kvcache(q: Tensor, kv_cache: Tensor, cache_seqlens: Tensor, block_table: Tensor | None,
                           causal: bool, softmax_scale: float, num_splits: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of MLA decode (``api.flash_mla_with_kvcache``; the cache is only read)."""
    return run_mla(q, kv_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits)


@flash_mla_with_kvcache.register_fake
def _mla_fake(q, kv_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits):
    check_mla_shapes(tuple(q.shape), tuple(kv_cache.shape), str(q.dtype), str(kv_cache.dtype),
                     configs.MLA_HEAD_DIMS[1])
    batch, seqlen_q, heads_q, _ = q.shape
    return (q.new_empty((batch, seqlen_q, heads_q, configs.MLA_HEAD_DIMS[1])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))
