"""The public API: route a torch call that needs autograd, torch.compile or fake tensors through
the custom ops (``torch_route``, imported when the first torch tensor arrives), and every other
call to its checked entry (``operations.entry``: validate, then run the operation).

Every check runs before anything is compiled or launched; the device path then costs a few
dictionary lookups and one launch (``operations.forward.run_device``). Torch tensors of a layout
validated before skip to the per-call checks and the launch (``operations.forward.run_torch``).
"""

from __future__ import annotations

from typing import Any

from .operands import check_flag, kind_of
from .operations import decode, head_dims
from .operations.entry import (
    direct_flash_attention,
    direct_flash_attention_backward,
    direct_flash_attention_with_kvcache,
    direct_flash_mla_with_kvcache,
)


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    out: Any = None,
    learnable_sink: Any = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
    out_dtype: Any = None,
) -> Any:
    """Exact attention ``O = softmax(Q Kᵀ · scale) V`` on tensor cores.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16.
        k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype; heads_q a multiple of
            heads_kv (GQA / MQA). head_dim 32, 64, 96, 128 or 256; any seqlen >= 1. Other
            head dims up to 256 (torch and numpy inputs) run on the next of those kernels with
            q, k and v copied into zero-padded buffers (``operations.head_dims``; the default
            scale stays 1/sqrt(head_dim)); out has the true head dim.
            All three numpy arrays (staged through page-locked memory in chunks on several
            streams; the result is a numpy array over pooled pinned memory), or all
            device arrays: torch CUDA tensors, CuPy arrays, Numba device arrays or any
            ``__cuda_array_interface__`` object (zero copy; the result stays on the device,
            of the same library for torch and CuPy, a Numba device array otherwise). Strided
            device inputs work when head_dim is contiguous and rows are 16-byte aligned.
            v's head dim may differ from q's and k's where a kernel has the pair
            (``configs.ASYMMETRIC_HEAD_DIMS``: (192, 128), DeepSeek-V3's); out then has v's head
            dim (Hopper: its TMA kernel, ``configs.ASYMMETRIC_WS_DEFAULTS``; other GPUs: the
            mma.sync kernel). ``flash_attention_with_kvcache`` takes the pair too. (512, 256) is a
            pair of the mma.sync kernels; head dim 512 (q, k and v; torch and numpy inputs) runs as
            one call of it per half of v (``operations.head_dims``), out the halves side by side.
        causal: (bool) mask keys after the diagonal, bottom-right aligned (query i sees key
            j iff j <= i + seqlen_k - seqlen_q). Rows that see no key give 0.
        softmax_scale: positive real scale of QKᵀ; default 1/sqrt(head_dim).
        window_size: (left, right) ints, FlashAttention's sliding window: query i sees key j
            iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 is
            unbounded; ``causal=True`` sets right to 0. Rows that see no key give 0 (LSE -inf).
            Key tiles wholly outside the window are never read: the cost follows the window.
        softcap: float >= 0; when > 0 the scaled scores s = QKᵀ · scale become
            softcap · tanh(s / softcap) before the softmax (Gemma 2, Grok); 0 turns it off.
            Both run the GPU's own kernel (on Hopper the TMA kernel at head dims 64, 96, 128
            and 256); both have a backward (``flash_attention_backward``, and autograd on
            torch tensors: the mma.sync backward on every GPU).
        return_lse: (bool) also return the float32 log-sum-exp, (batch, heads_q, seqlen_q);
            -inf for rows that see no key.
        out: optional output array (same shape and dtype as q, same kind as the inputs,
            writeable, no element sharing memory with another; a device out must not
            overlap k or v, but may be q itself).
        learnable_sink: optional float32 (heads_q,) device array, FlashAttention-4's
            ``learnable_sink`` (gpt-oss, StreamingLLM): one logit per query head, natural-log
            units, neither scaled nor softcapped, added to every row's softmax with no value
            row: out = Σ_j p_j v_j with p = softmax over the row's scores and the sink, so the
            p_j sum to less than 1; the LSE includes the sink; rows that see no key give 0 and
            LSE = the sink. A kernel variant of its own (compiled on first use), on both kernel
            families. Device inputs only. Its backward: ``flash_attention_backward(...,
            learnable_sink=)``; under autograd the sink may require grad.
        q_descale, k_descale, v_descale: FP8 inputs only (FlashAttention-3's API): q, k and v of
            dtype ``float8_e4m3fn`` (torch CUDA tensors, or numpy ``ml_dtypes`` arrays) hold
            x / descale; each descale is a float32 torch tensor of shape (batch, heads_kv) (q's
            heads share their KV head's), None for 1. Hopper only; head dims 64, 128 and 256;
            causal, GQA, window, softcap and a learnable sink as in 16 bits; packed sequences
            through ``flash_attention_varlen``; no backward. ``numbaflash.fp8.quantize`` makes the
            inputs and descales.
        out_dtype: FP8 inputs only: the output's dtype, torch.bfloat16 (default) or torch.float16.

    Raises:
        TypeError, ValueError: bad input, before anything is compiled or launched.
        NotImplementedError: a learnable sink with numpy inputs.
        RuntimeError: no usable GPU of compute capability 8.0 or newer.

    Returns:
        ``out`` (batch, seqlen_q, heads_q, v's head_dim) in q's dtype (FP8: in ``out_dtype``), or
        ``(out, lse)``.

    On torch tensors that need autograd (or under torch.compile, a fake-tensor mode or
    another dispatch mode) the call goes through the custom op ``numbaflash::
    flash_attention_forward`` (``torch_ops``), which is differentiable; ``out=`` then cannot
    be combined with autograd.
    """
    if _is_fp8(q, q_descale, k_descale, v_descale, out_dtype):
        return _fp8(q, k, v, None, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                        causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                        softcap=softcap, return_lse=return_lse, out=out,
                                        learnable_sink=learnable_sink, out_dtype=out_dtype))
    kind = kind_of(q)
    padded = head_dims.padding_for(q, k, v, kind, 4)
    if padded is not None:
        return _padded_forward(flash_attention, padded, kind, q, k, v, (), causal, softmax_scale, window_size,
                               softcap, return_lse, out, learnable_sink)
    if kind == "torch":
        route = (_TORCH_ROUTE or _torch_route())[0]
        if learnable_sink is None:
            routed = route(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap)
        else:
            routed = route(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap,
                           learnable_sink)
        if routed is not None:
            return routed
    if learnable_sink is None:
        return direct_flash_attention(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap)
    return direct_flash_attention(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap,
                                  learnable_sink)


_TORCH_ROUTE: list = []  # [torch_route.route], once a torch tensor has reached the API


def _is_fp8(q: Any, q_descale: Any, k_descale: Any, v_descale: Any, out_dtype: Any) -> bool:
    """A call for the FP8 forward: one-byte q, or any FP8-only argument (whose checks then say
    what is wrong with 16-bit inputs)."""
    return (q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None
            or getattr(getattr(q, "dtype", None), "itemsize", 2) == 1)


def _fp8(q: Any, k: Any, v: Any, lengths: tuple | None, options: dict) -> Any:
    """An FP8 call (``operations.fp8_forward.fp8_attention``), through its custom op where torch
    traces (``torch_route.route_fp8``)."""
    from .operations.fp8_forward import fp8_attention

    if kind_of(q) == "torch":
        from .torch_route import route_fp8

        routed = route_fp8(q, k, v, lengths, options)
        if routed is not None:
            return routed
    return fp8_attention(q, k, v, lengths, options)


def _needs_grad(kind: str, *tensors: Any) -> bool:
    if kind != "torch":
        return False
    import torch

    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _padded_forward(call: Any, padded: int, kind: str, q: Any, k: Any, v: Any, lengths: tuple, causal: Any,
                    softmax_scale: Any, window_size: Any, softcap: Any, return_lse: Any, out: Any,
                    learnable_sink: Any) -> Any:
    """``call`` (``flash_attention`` or ``flash_attention_varlen``, whose ``lengths`` are the
    offsets and maxima) on q, k and v zero-padded to head dim ``padded`` (``head_dims``), or split
    where ``padded`` is a ``head_dims.Split``."""
    name = call.__name__
    if out is not None and _needs_grad(kind, q, k, v, learnable_sink):
        raise RuntimeError(f"{name}(): out= does not support automatic differentiation, but q, k, v or "
                           f"learnable_sink requires grad; call it without out= (or under torch.no_grad())")
    return_lse = check_flag("return_lse", return_lse)
    if isinstance(padded, head_dims.Split):
        return _split_forward(call, padded, kind, q, k, v, lengths, causal, softmax_scale, window_size,
                              softcap, return_lse, out, learnable_sink)
    d_qk, d_v = q.shape[-1], v.shape[-1]
    inputs = (head_dims.pad(x, padded, kind) for x in (q, k, v))
    scale = head_dims.default_scale(softmax_scale, d_qk)
    result = call(*inputs, *lengths, causal=causal, softmax_scale=scale, window_size=window_size,
                  softcap=softcap, return_lse=return_lse, learnable_sink=learnable_sink)
    o, lse = result if return_lse else (result, None)
    o = head_dims.deliver(head_dims.narrow(o, d_v, kind), out, "out", kind)
    return (o, lse) if return_lse else o


def _padded_backward(call: Any, padded: int, kind: str, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                     lengths: tuple, options: dict, given: tuple) -> tuple[Any, ...]:
    """``call`` (``flash_attention_backward`` or its varlen sibling) on the inputs zero-padded to
    head dim ``padded`` (``head_dims``), or split where ``padded`` is a ``head_dims.Split``;
    ``given``: the caller's dq, dk, dv (or None)."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    head_dims.check_value_dim(dout, d_v, "dout")
    head_dims.check_value_dim(out, d_v, "out")
    if isinstance(padded, head_dims.Split):
        return _split_backward(call, padded, kind, dout, q, k, v, out, lse, lengths, options, given)
    options["softmax_scale"] = head_dims.default_scale(options["softmax_scale"], d_qk)
    grads = call(*(head_dims.pad(x, padded, kind) for x in (dout, q, k, v, out)), lse, *lengths, **options)
    named = zip(("dq", "dk", "dv"), grads[:3], (d_qk, d_qk, d_v), given, strict=True)
    return (*(head_dims.deliver(head_dims.narrow(g, d, kind), mine, name, kind)
              for name, g, d, mine in named), *grads[3:])


def _split_forward(call: Any, part: int, kind: str, q: Any, k: Any, v: Any, lengths: tuple, causal: Any,
                   softmax_scale: Any, window_size: Any, softcap: Any, return_lse: Any, out: Any,
                   learnable_sink: Any) -> Any:
    """``call`` (``flash_attention`` or ``flash_attention_varlen``) once per ``part`` columns of v
    (``head_dims``: head dim 512 as the pair (512, 256)); out is the parts side by side, the LSE
    the first call's (every call's scores are the same). ``_padded_forward`` checked out= and
    return_lse."""
    options = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size,
               "softcap": softcap, "learnable_sink": learnable_sink}
    first, *rest = head_dims.parts(v, part, kind)
    o, lse = call(q, k, first, *lengths, return_lse=True, **options)
    o = head_dims.join([o, *(call(q, k, vp, *lengths, **options) for vp in rest)], kind)
    o = head_dims.deliver(o, out, "out", kind)
    return (o, lse) if return_lse else o


def _split_backward(call: Any, part: int, kind: str, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                    lengths: tuple, options: dict, given: tuple) -> tuple[Any, ...]:
    """``call`` (``flash_attention_backward`` or its varlen sibling) once per ``part`` columns of v,
    dout and out (``head_dims``): dv is the parts' side by side, dq, dk (and d_sink) the calls'
    sums. ``given``: the caller's dq, dk, dv (or None); ``_padded_backward`` checked dout and out."""
    calls = [call(dp, q, k, vp, op, lse, *lengths, **options)
             for dp, vp, op in zip(*(head_dims.parts(x, part, kind) for x in (dout, v, out)), strict=True)]
    summed = [sum(each[1:], each[0]) for each in zip(*calls, strict=True)]  # dq, dk (and d_sink)
    summed[2] = head_dims.join([grads[2] for grads in calls], kind)  # dv: side by side
    named = zip(("dq", "dk", "dv"), summed[:3], given, strict=True)
    return (*(head_dims.deliver(g, mine, name, kind) for name, g, mine in named), *summed[3:])


def _torch_route() -> list:
    from .torch_route import route

    _TORCH_ROUTE.append(route)
    return _TORCH_ROUTE


def flash_attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: Any = None,
) -> tuple[Any, ...]:
    """Gradients of ``O = softmax(Q Kᵀ · scale) V`` with respect to q, k and v, on tensor cores
    (FlashAttention-2's backward: the mma.sync kernels, which every GPU from sm_80 on runs).

    Args:
        dout: (batch, seqlen_q, heads_q, head_dim), the gradient of the loss with respect to
            ``out``; q's dtype.
        q: (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, as given to the forward.
        k, v: (batch, seqlen_k, heads_kv, head_dim), q's dtype; heads_q a multiple of heads_kv
            (GQA / MQA). head_dim 32, 64, 96, 128 or 256, or (torch and numpy inputs) any other
            up to 256, run padded as the forward runs it, or 512, run per half of v (dq and dk the
            halves' sums, dv side by side); any seqlen >= 1.
        out: (batch, seqlen_q, heads_q, head_dim), q's dtype: the forward's output.
        lse: (batch, heads_q, seqlen_q) float32, the forward's log-sum-exp as
            ``flash_attention(..., return_lse=True)`` returns it (-inf on rows that see no
            key); a C-contiguous device array for device inputs, any numpy array for numpy.
            All inputs numpy arrays (staged through page-locked memory; the gradients are
            numpy arrays over pooled pinned memory), or all device arrays: torch CUDA tensors,
            CuPy arrays, Numba device arrays or any ``__cuda_array_interface__`` object (zero
            copy, launched on the inputs' stream; new gradients and the float32 workspace are
            allocated by the inputs' library: ``torch.empty`` for torch, so the call works
            under CUDA-graph capture). Strided device inputs work when head_dim is contiguous
            and rows are 16-byte aligned.
        causal: (bool) the forward's masking: bottom-right aligned (query i sees key j iff
            j <= i + seqlen_k - seqlen_q).
        softmax_scale: the forward's positive real scale of QKᵀ; default 1/sqrt(head_dim).
        deterministic: (bool) bit-identical gradients from run to run: each query block's dQ
            is summed over the key blocks in one order (slower); otherwise the float32 additions
            into dQ land in whatever order the CTAs reach them.
        dq, dk, dv: optional output arrays, like q, k and v (same kind, shape and dtype),
            writeable, with no element sharing memory with another, and sharing no memory with
            any input or each other. None: a new array (C-contiguous).
        window_size: the forward's (left, right) sliding window, FlashAttention's rule (query i
            sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
            right; -1 unbounded; ``causal`` sets right to 0). A key block's work covers only
            the query blocks that see it; keys no query sees get dk = dv = 0.
        softcap: the forward's (0: off; > 0: scores softcap · tanh(QKᵀ · scale / softcap)); the
            gradients go through the tanh. ``lse`` must be the forward's of the same window and
            softcap.
        learnable_sink: the forward's float32 (heads_q,) device array (FlashAttention-4's
            ``learnable_sink``; ``lse`` must be the forward's with it, which includes the sink).
            dq, dk, dv are then those of the sink softmax, and the gradient of the sink comes
            back too, as FlashAttention-4's ``_flash_attn_bwd`` returns it:
            d_sink[h] = -Σ over batches and rows of exp(sink[h] - lse) · rowsum(dout ∘ out)
            (float32, summed with float32 atomics: not bit-identical from run to run, even in
            deterministic mode). Device inputs only.

    Raises:
        TypeError, ValueError: bad input (window, softcap and learnable sink: the forward's
            checks), before anything is compiled or launched.
        NotImplementedError: a learnable sink with numpy inputs.
        RuntimeError: no usable GPU of compute capability 8.0 or newer, or no backward tile of
            this head dim fits the GPU's shared memory (head_dim 256 on GPUs of 99 KB a CTA:
            sm_86, sm_89, sm_120).

    Returns:
        ``(dq, dk, dv)``: dq like q (batch, seqlen_q, heads_q, head_dim), dk and dv like k
        (batch, seqlen_k, heads_kv, head_dim), in q's dtype. With GQA / MQA the dk and dv of a
        KV head sum over its query heads. Rows that see no key (causal, seqlen_q > seqlen_k)
        get zero gradients, and give none to k and v. With a ``learnable_sink``:
        ``(dq, dk, dv, d_sink)``, d_sink a new float32 (heads_q,) array of the inputs' library.
    """
    kind = kind_of(q)
    padded = head_dims.padding_for(q, k, v, kind, 4)
    if padded is not None:
        options = {"causal": causal, "softmax_scale": softmax_scale, "deterministic": deterministic,
                   "window_size": window_size, "softcap": softcap, "learnable_sink": learnable_sink}
        return _padded_backward(flash_attention_backward, padded, kind, dout, q, k, v, out, lse, (), options,
                                (dq, dk, dv))
    return direct_flash_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                                           dq, dk, dv, window_size, softcap, learnable_sink)

def flash_attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    *,
    k_new: Any = None,
    v_new: Any = None,
    block_table: Any = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    return_lse: bool = False,
    out: Any = None,
    learnable_sink: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    rotary_interleaved: bool = False,
) -> Any:
    """Attention of a few new query rows against a KV cache (FlashAttention's
    ``flash_attn_with_kvcache``).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim) float16 or bfloat16 device array; seqlen_q
            from 1 (decode) to a few (speculative decoding).
        k_cache, v_cache: (batch, capacity, heads_kv, head_dim), q's dtype; with
            ``block_table``, a paged cache (num_pages, page_size, heads_kv, head_dim). v_cache (and
            v_new, and out) may have another head dim than q and k_cache where a kernel has the pair
            (``configs.ASYMMETRIC_HEAD_DIMS``: (192, 128)).
        cache_seqlens: int32 (batch,) device array: the valid rows of each sequence's cache.
        k_new, v_new: optional (batch, seqlen_new, heads_kv, head_dim), q's dtype: written into
            the cache in place at rows cache_seqlens[b] .. + seqlen_new, and attended to. The
            caller advances ``cache_seqlens``. Rows past the cache's capacity are not written.
        block_table: optional int32 (batch, max_pages): page i of sequence b is
            ``block_table[b, i]``.
        causal: query i (of seqlen_q) sees keys j <= L - seqlen_q + i, L = cache_seqlens[b] +
            seqlen_new (bottom-right); else every key below L.
        softmax_scale: default 1/sqrt(head_dim).
        window_size: (left, right) ints, FlashAttention's sliding window: query i (of
            seqlen_q) of sequence b sees key j iff i + L - seqlen_q - left <= j <= i + L -
            seqlen_q + right, L = cache_seqlens[b] + seqlen_new (read on the device, so a
            captured graph follows it); -1 is unbounded; ``causal=True`` sets right to 0. Key
            tiles below a window are never read: the cost follows the window, not the cache
            (the split count then divides the window's tiles). Rows that see no key give 0
            (LSE -inf). The new rows are appended whether the window sees them or not.
        softcap: float >= 0; when > 0 the scaled scores s = QKᵀ · scale become
            softcap · tanh(s / softcap) before the softmax (Gemma 2, Grok); 0 turns it off.
            A window or a softcap runs a variant of the decode kernel, compiled on first use.
        num_splits: CTAs that share one sequence's keys; 0 chooses from the shapes and the SM
            count (never from ``cache_seqlens``' values, so a captured graph stays valid).
        return_lse: also return the float32 (batch, heads_q, seqlen_q) log-sum-exp.
        out: optional output array like q.
        learnable_sink: optional float32 (heads_q,) device array, as for ``flash_attention``
            (FlashAttention-4's ``learnable_sink``): one logit per query head in every row's
            softmax, with no value row; the LSE includes it; rows that see no key give 0 and LSE
            = the sink. A build of the decode kernel of its own, compiled on first use.
        cache_batch_idx: optional int32 (batch,) device array (FlashAttention's): sequence b reads
            and appends to the cache's batch row cache_batch_idx[b] (paged: the block table's row,
            as FlashAttention-3 does), so k_cache / v_cache (or block_table) may hold more rows
            than q has sequences. cache_seqlens, cache_leftpad, q, k_new and v_new stay indexed
            by b. Values must be valid rows (not checked: read on the device).
        cache_leftpad: optional int32 (batch,) device array (FlashAttention's): sequence b's keys
            start at cache row cache_leftpad[b] (0 <= cache_leftpad[b] <= cache_seqlens[b]); rows
            before it are never read. The sequence then has L = cache_seqlens[b] -
            cache_leftpad[b] + seqlen_new keys, cache rows cache_leftpad[b] .. cache_seqlens[b] - 1
            and the new rows, appended at cache rows cache_seqlens[b] .. as without it; the
            causal diagonal and the window above are placed by that L. Paged caches too (key j
            at row cache_leftpad[b] + j of the sequence's pages, as FlashAttention-3).
            Each of these two options is a build of the decode kernel of its own (compiled on
            first use); both are read on the device, so a captured graph follows their values.
        rotary_cos, rotary_sin: optional device arrays of q's dtype, (seqlen_ro, rotary_dim / 2)
            with rotary_dim a multiple of 16 up to head_dim and seqlen_ro at least the cache's rows
            a sequence (FlashAttention's): the rotary embedding is applied, inside the call, to
            the first rotary_dim columns of q and of k_new (before k_new is appended, so the cache
            holds the rotated keys), in float32, rounded to the dtype. New row t of sequence b sits
            at position cache_seqlens[b] + t; query i at cache_seqlens[b] + i in a causal or
            windowed call, else every query at cache_seqlens[b] (FlashAttention's rule; with
            cache_leftpad too, positions are cache rows). Needs k_new and v_new.
        rotary_interleaved: False (GPT-NeoX): column i pairs with i + rotary_dim / 2; True (GPT-J):
            columns 2i and 2i + 1 pair. A build of the decode kernel of its own for each.

    On torch tensors under torch.compile (or fake tensors, a dispatch mode) the call goes
    through the custom op ``numbaflash::flash_attention_with_kvcache`` (``torch_ops``), which
    declares the in-place append (``mutates_args``), so a compiled decode step has no break.

    Raises:
        TypeError, ValueError: bad input (window and softcap: the forward's checks), before
            anything is compiled or launched.

    Returns:
        ``out`` (batch, seqlen_q, heads_q, head_dim), and the float32 (batch, heads_q, seqlen_q)
        LSE with ``return_lse``.
    """
    if kind_of(q) == "torch":  # torch.compile, fake tensors: the custom op
        from .torch_route import route_kvcache

        routed = route_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                               softmax_scale, num_splits, return_lse, out, window_size, softcap,
                               learnable_sink, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                               rotary_interleaved)
        if routed is not None:
            return routed
        done = decode.run_torch(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                                softmax_scale, num_splits, return_lse, out, window_size, softcap,
                                learnable_sink, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                                rotary_interleaved)
        if done is not None:
            return done
    if (learnable_sink is None and cache_batch_idx is None and cache_leftpad is None and rotary_cos is None
            and rotary_sin is None):
        return direct_flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                   block_table, causal, softmax_scale, num_splits, return_lse,
                                                   out, window_size, softcap)
    return direct_flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                               causal, softmax_scale, num_splits, return_lse, out,
                                               window_size, softcap, learnable_sink, cache_batch_idx,
                                               cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved)


def flash_mla_with_kvcache(
    q: Any,
    kv_cache: Any,
    cache_seqlens: Any,
    block_table: Any = None,
    *,
    head_dim_v: int = 512,
    causal: bool = False,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    out: Any = None,
) -> Any:
    """Multi-head latent attention decode (DeepSeek-V2/V3, Kimi K2), in FlashMLA's spirit: every
    query head attends to one shared latent cache, whose row of 576 values a token is the key and
    whose first 512 values are the value (the absorbed-weights form).

    Args:
        q: (batch, seqlen_q, heads_q, 576) float16 or bfloat16 device array (torch, CuPy, Numba);
            heads_q any count (16-128 in the models); seqlen_q from 1 (decode) to a few
            (multi-token prediction).
        kv_cache: q's dtype; with ``block_table`` a paged cache (num_pages, page_size, 1, 576) of
            any page size (FlashMLA's 64, vLLM's 16, SGLang's 1), else (batch, capacity, 1, 576).
            Read only: the caller writes new rows into it.
        cache_seqlens: int32 (batch,) device array: the valid rows of each sequence (read on the
            device, so a captured CUDA graph follows them). Rows past them are never read.
        block_table: optional int32 (batch, max_pages): page i of sequence b is
            ``block_table[b, i]``.
        head_dim_v: 512, V's (and the output's) head dim, as FlashMLA's argument of that name.
        causal: query i (of seqlen_q) sees keys j <= L - seqlen_q + i, L = cache_seqlens[b]
            (bottom-right, FlashMLA's rule); else every key below L. Rows that see no key give 0
            (LSE -inf).
        softmax_scale: default 1/sqrt(576), as FlashMLA's.
        num_splits: CTAs that share one sequence's keys; 0 chooses from the shapes and the SM
            count (never from cache_seqlens' values).
        return_lse: also return the float32 (batch, heads_q, seqlen_q) log-sum-exp (natural log).
        out: optional (batch, seqlen_q, heads_q, 512) device array of q's dtype.

    The kernel (``kernels.mla_decode``, mma.sync, every GPU from sm_80) reads the cache once per
    64 query rows (heads x seqlen_q) and is compiled on first use. Under torch.compile (or fake
    tensors, a dispatch mode) the call is the custom op ``numbaflash::flash_mla_with_kvcache``, so a
    compiled decode step has no graph break (``out=`` is refused there).

    Raises:
        TypeError, ValueError: bad input, before anything is compiled or launched.

    Returns:
        ``out`` (batch, seqlen_q, heads_q, 512), and with ``return_lse`` the LSE.
    """
    if kind_of(q) == "torch":  # torch.compile, fake tensors: the custom op
        from .torch_route import route_mla

        routed = route_mla(q, kv_cache, cache_seqlens, block_table, head_dim_v, causal, softmax_scale,
                           num_splits, return_lse, out)
        if routed is not None:
            return routed
    return direct_flash_mla_with_kvcache(q, kv_cache, cache_seqlens, block_table, head_dim_v, causal,
                                         softmax_scale, num_splits, return_lse, out)


def flash_attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    out: Any = None,
    learnable_sink: Any = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
    out_dtype: Any = None,
) -> Any:
    """Attention over a packed batch of sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func``), each sequence attending to its own keys only.

    Args:
        q: (total_q, heads_q, head_dim) float16 or bfloat16: the sequences' query rows, packed.
        k, v: (total_k, heads_kv, head_dim), q's dtype; heads_q a multiple of heads_kv (GQA /
            MQA); head_dim 32, 64, 96, 128 or 256 (others as for ``flash_attention``: padded up
            to 256, 512 per half of v). All numpy arrays or all device arrays (torch
            CUDA tensors, CuPy, Numba device arrays), as for ``flash_attention``.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative offsets: sequence b owns query
            rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and key rows cu_seqlens_k[b] ..
            cu_seqlens_k[b + 1] - 1 (empty sequences allowed). Device arrays for device inputs
            (their values are never read on the host: the call can be captured in a CUDA graph),
            numpy arrays for numpy inputs (then checked: start at 0, non-decreasing, end at
            total, no sequence longer than the maxima).
        max_seqlen_q, max_seqlen_k: positive ints, at least every sequence's length (the grid
            covers max_seqlen_q query rows a sequence; not checked on device offsets).
        causal, softmax_scale, window_size, softcap: as for ``flash_attention``, per sequence
            (bottom-right: query i of a sequence sees key j iff j <= i + seqlen_k - seqlen_q with
            that sequence's own lengths).
        return_lse: also return the float32 LSE, (heads_q, total_q); -inf on rows that see no key.
        out: optional output like q.
        learnable_sink: optional float32 (heads_q,) device array, as for ``flash_attention``
            (each sequence's rows; a row that sees no key gives 0 and LSE = the sink).
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs only, as for ``flash_attention``:
            e4m3 q, k and v (torch CUDA tensors with int32 CUDA offsets, or numpy ``ml_dtypes``
            arrays with numpy offsets), descales float32 (batch, heads_kv), one row per sequence;
            out in ``out_dtype`` (bfloat16 by default). Hopper only, head dims 64, 128 and 256.

    Runs the GPU's own kernel: on Hopper at head dims 64, 96, 128 and 256 the TMA kernel, whose
    persistent schedule walks only the blocks that lie in a sequence; elsewhere the mma.sync
    kernel, one CTA per block of max_seqlen_q (those past a sequence's end exit at once). Torch
    tensors that require grad train through the varlen torch op (its backward:
    ``flash_attention_varlen_backward``); ``out=`` then raises.

    Returns:
        ``out`` (total_q, heads_q, head_dim) in q's dtype, or ``(out, lse)``.
    """
    if _is_fp8(q, q_descale, k_descale, v_descale, out_dtype):
        return _fp8(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                    dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=causal,
                         softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                         return_lse=return_lse, out=out, learnable_sink=learnable_sink, out_dtype=out_dtype))
    from .operations.varlen import direct_flash_attention_varlen

    kind = kind_of(q)
    padded = head_dims.padding_for(q, k, v, kind, 3)
    if padded is not None:
        lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return _padded_forward(flash_attention_varlen, padded, kind, q, k, v, lengths, causal, softmax_scale,
                               window_size, softcap, return_lse, out, learnable_sink)
    if kind == "torch":
        from .torch_route import route_varlen

        routed = route_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                              softmax_scale, window_size, softcap, return_lse, out, learnable_sink)
        if routed is not None:
            return routed
    return direct_flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         causal, softmax_scale, window_size, softcap, return_lse, out,
                                         learnable_sink)


def flash_attention_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    learnable_sink: Any = None,
) -> tuple[Any, ...]:
    """Gradients of ``flash_attention_varlen`` with respect to q, k and v (the mma.sync backward's
    packed variable-length build, on every GPU from sm_80 on).

    Args:
        dout: (total_q, heads_q, head_dim), q's dtype: the gradient of the loss with respect to out.
        q: (total_q, heads_q, head_dim) float16 or bfloat16; k, v: (total_k, heads_kv, head_dim),
            as given to the forward (all numpy arrays or all device arrays, as there).
        out: (total_q, heads_q, head_dim): the forward's output.
        lse: (heads_q, total_q) float32: the forward's LSE (``return_lse=True``), C-contiguous on
            the device for device inputs.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the forward's (int32 (batch + 1,)
            offsets; device arrays never read on the host: CUDA-graph safe).
        causal, softmax_scale, window_size, softcap: the forward's, per sequence.
        deterministic: (bool) bit-identical gradients from run to run (each query block's dQ
            summed over its key blocks in one order).
        dq, dk, dv: optional outputs like q, k, v (as for ``flash_attention_backward``).
        learnable_sink: the forward's float32 (heads_q,) device array, as for
            ``flash_attention_backward``: d_sink (summed over every sequence) comes back too.

    Raises:
        TypeError, ValueError: bad input (the varlen forward's checks, the backward's for dout,
            out, lse and the gradients), before anything is compiled or launched.
        NotImplementedError: a learnable sink with numpy inputs.

    Returns:
        ``(dq, dk, dv)`` packed like q, k, v in q's dtype; each sequence's are those of a dense
        backward on that sequence alone (bit for bit in deterministic mode); keys of a sequence
        without queries get zero dk and dv. With GQA / MQA dk and dv sum over a KV head's group.
        With a ``learnable_sink``: ``(dq, dk, dv, d_sink)``, d_sink float32 (heads_q,).
    """
    kind = kind_of(q)
    padded = head_dims.padding_for(q, k, v, kind, 3)
    if padded is not None:
        options = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size,
                   "softcap": softcap, "deterministic": deterministic, "learnable_sink": learnable_sink}
        lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return _padded_backward(flash_attention_varlen_backward, padded, kind, dout, q, k, v, out, lse,
                                lengths, options, (dq, dk, dv))
    from .operations.varlen_backward import direct_flash_attention_varlen_backward

    return direct_flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                                                  window_size, softcap, deterministic, dq, dk, dv,
                                                  learnable_sink)
