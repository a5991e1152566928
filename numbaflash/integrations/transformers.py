"""Hugging Face transformers on numbaflash: ``attn_implementation="numbaflash"``.

    import torch
    from transformers import AutoModelForCausalLM
    from numbaflash.integrations.transformers import register

    register()  # once per process
    model = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation="numbaflash", dtype=torch.bfloat16, device_map="cuda")

``from_config(config, attn_implementation="numbaflash")`` and
``model.set_attn_implementation("numbaflash")`` work too. Install with ``pip install
numbaflash[transformers]``.

How it fits in. transformers treats every implementation whose name holds "flash" as a
FlashAttention: it builds FlashAttention's masks (a 2-D padding mask, or none), and before the
first call it asks its FlashAttention loader for the package's ``flash_attn_func`` and
``flash_attn_varlen_func``. ``register`` gives it ours (``flash_attn_func``,
``flash_attn_varlen_func`` below: FlashAttention's signatures on ``numbaflash.flash_attention``
and ``flash_attention_varlen``), so transformers' own FlashAttention path runs on numbaflash's
kernels, as it runs on flash-attn's:

* a batch with a 2-D padding mask is unpadded, attended with ``flash_attention_varlen`` and
  padded back (left padding in ``generate`` included);
* packed sequences, given as ``position_ids`` that restart or as ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` keywords, run through ``flash_attention_varlen`` without padding;
* a decode step (at most ``DECODE_ROWS`` query rows), through
  ``flash_attention_with_kvcache`` on transformers' cache as it is, each sequence's first and
  last key found from the padding mask on the device, or every key without one
  (``decode_step``);
* anything else (a prefill without padding) through ``flash_attention``, causal bottom-right as
  FlashAttention's, called directly (``dense``): transformers' path would test a batch of one's
  ``position_ids`` for packing in every layer, a host sync each; ``packed`` tests once a forward.

The model's options come from its attention modules and config, as transformers passes them to
FlashAttention: GQA (K and V keep their heads), ``scaling``, the layer's sliding window (as
``window_size=(w - 1, w - 1)`` with causal, FlashAttention's convention in transformers),
logit softcapping, learnable sinks (``s_aux``, gpt-oss) and V's head dim where it differs from
Q's and K's (``numbaflash.configs.ASYMMETRIC_HEAD_DIMS``). Autograd, gradient checkpointing and
``torch.compile`` go through numbaflash's torch ops.

Refused, with one clear error:

* at load time, a model class that does not take FlashAttention in transformers
  (``_supports_flash_attn``), or whose head dims have no kernel;
* at call time, attention dropout during training (no kernel has it: set the config's
  ``attention_dropout`` to 0), ``output_attentions=True`` (no kernel forms the matrix) and
  transformers' paged cache of continuous batching (``block_table``, ``k_cache``, ``v_cache``).

Measured (H200, Llama 8 layers, GQA 16/4, d128, bf16; docs/PERFORMANCE.md): decode steps on
the KV-cache kernel generate 2.3x faster than on transformers' path (dynamic cache, batch 4:
422 against 186 tokens/s), whose decode steps sync the host in every layer (``_upad_input``) and,
with the static cache compiled, break the graph there; so decode steps take the KV-cache kernel.
Against SDPA on the same model (``benchmarks/hf_speed.py``, ``examples/hf_finetune.py``; ten
runs on six machines, docs/PERFORMANCE.md [HF4]): static-cache ``generate`` with CUDA graphs
1.00-1.19x at batch 1 and 1.03-1.28x at batch 16; prefill at 4k 0.98-1.03x and a training step at
4k 0.94-1.03x, and 1.02-1.03x in the last three runs (the current kernels). The packed-sequence
test (``packed``) reads the device once a forward for a batch of one sequence called with
``position_ids``: about 2 ms a step where the training loop never waits for the device (it waits
there for the previous step's work). A model called without them makes consecutive ones, which
are not read (``made_positions``).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

from ..configs import ASYMMETRIC_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from ..operations.head_dims import MAX_HEAD_DIM, kv_cache_native, runs
from .flash_attn import offsets_of as _offsets
from .flash_attn import refuse_dropout as _refuse_dropout
from .flash_attn import scale_of as _scale
from .flash_attn import softcap_of as _softcap
from .flash_attn import window_of as _window

NAME = "numbaflash"
_NAMES: set[str] = set()  # names registered in this process


# ------------------------------------------------------------------ FlashAttention's signatures


def flash_attn_func(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float | None = 0.0, learnable_sink: Any = None) -> Any:
    """FlashAttention's ``flash_attn_func`` on ``numbaflash.flash_attention``.

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim or v's),
    torch CUDA tensors of one 16-bit dtype; ``learnable_sink`` (heads_q,) of any float dtype (taken
    as float32, its gradient flowing back). Returns out (batch, seqlen_q, heads_q, v's head dim).
    ``dropout_p`` must be 0."""
    from .. import api

    _refuse_dropout(dropout_p)
    return api.flash_attention(q, k, v, causal=bool(causal), softmax_scale=_scale(softmax_scale),
                               window_size=_window(window_size), softcap=_softcap(softcap),
                               learnable_sink=_sink(learnable_sink))


def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                           max_seqlen_k: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                           causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                           softcap: float | None = 0.0, learnable_sink: Any = None) -> Any:
    """FlashAttention's ``flash_attn_varlen_func`` on ``numbaflash.flash_attention_varlen``.

    q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim or v's); cu_seqlens_q and
    cu_seqlens_k (batch + 1,) integer tensors on q's device (taken as int32); max_seqlen_q and
    max_seqlen_k ints (or one-element tensors). Returns out (total_q, heads_q, v's head dim)."""
    from .. import api

    _refuse_dropout(dropout_p)
    return api.flash_attention_varlen(q, k, v, _offsets(cu_seqlens_q), _offsets(cu_seqlens_k),
                                      int(max_seqlen_q), int(max_seqlen_k), causal=bool(causal),
                                      softmax_scale=_scale(softmax_scale), window_size=_window(window_size),
                                      softcap=_softcap(softcap), learnable_sink=_sink(learnable_sink))


def _sink(sink: Any) -> Any:
    """transformers hands FlashAttention the sink in q's dtype; numbaflash takes float32."""
    if sink is None:
        return None
    import torch

    return sink.to(torch.float32).contiguous()


# ------------------------------------------------------------------ the attention function


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, is_causal: bool | None = None, s_aux: Any = None,
                      **kwargs: Any) -> tuple[Any, None]:
    """The function ``register`` puts in transformers' ``AttentionInterface``: query (batch,
    heads_q, seqlen_q, head_dim), key and value (batch, heads_kv, seqlen_k, head_dim or v's) as the
    attention modules give them; ``attention_mask`` FlashAttention's (a 2-D padding mask or None).
    Returns (out (batch, seqlen_q, heads_q, v's head dim), None). A decode step (``decodes``)
    runs ``flash_attention_with_kvcache`` on the cache as it is (``decode_step``); everything
    else transformers' FlashAttention path (padding, packing, options) with ``flash_attn_func``
    and ``flash_attn_varlen_func`` underneath."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    from ..torch_route import attention_autograd

    if kwargs.get("output_attentions", False):
        raise ValueError("numbaflash does not return attention weights (output_attentions=True): "
                         "use attn_implementation='eager' for them")
    if any(kwargs.get(k) is not None for k in PAGED_KEYWORDS):
        raise NotImplementedError("numbaflash's transformers integration does not take transformers' "
                                  "paged cache (continuous batching: block_table, k_cache, v_cache); "
                                  "generate with a dynamic or static cache, or use another "
                                  "attn_implementation for continuous batching")
    seqlen_q = query.shape[2]
    is_causal = module.is_causal if is_causal is None else is_causal
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    target_dtype = get_target_dtype(query, module)
    if target_dtype is not None:  # float32 activations (PEFT's float32 norms): the kernels' dtype
        query, key, value = (x.to(target_dtype) for x in (query, key, value))
    if _CONTEXT_PARALLEL:
        return context_parallel_step(query, key, value, attention_mask, dropout, scaling, sliding_window,
                                     softcap, is_causal, s_aux, kwargs), None
    window = (-1, -1)
    if sliding_window is not None and key.shape[1] > sliding_window:  # transformers' rule
        window = (sliding_window - 1, sliding_window - 1)
    if decodes(query, attention_mask, key, value, module, kwargs):
        _refuse_dropout(dropout)
        out = decode_step(query, key, value, attention_mask, is_causal, scaling, softcap, s_aux, window)
        return out, None
    if dense(query, attention_mask, kwargs):
        if s_aux is None and not dropout:  # training: the options the last layer's call checked
            out = attention_autograd(query, key, value, bool(is_causal), _scale(scaling), window,
                                     _softcap(softcap))
            if out is not None:
                return out, None
        return flash_attn_func(query, key, value, dropout, scaling, is_causal, window, softcap, s_aux), None
    out = _flash_attention_forward(
        query, key, value, attention_mask, query_length=seqlen_q, is_causal=is_causal, dropout=dropout,
        softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap, use_top_left_mask=False,
        target_dtype=None, attn_implementation=module.config._attn_implementation,
        layer_idx=getattr(module, "layer_idx", None), s_aux=s_aux, **kwargs)
    return out, None


# ------------------------------------------------------------------ context parallelism

_CONTEXT_PARALLEL: dict = {}  # {"group": ..., "layout": ...} inside ``context_parallel``


@contextlib.contextmanager
def context_parallel(group: Any = None, layout: str = "zigzag") -> Iterator[None]:
    """Within the block, every attention call of a model on numbaflash is context-parallel:
    ``numbaflash.distributed.ring_attention`` over ``group`` (None: the default process group)
    on this rank's shard of the sequence, in ``layout``.

    Each rank feeds the model its shard of the tokens (``numbaflash.distributed.shard(ids,
    layout, world, rank)``) with their global ``position_ids`` (``positions``), so that rotary
    embeddings see the gathered sequence's positions; labels must be shifted on the gathered
    sequence before they are sharded (the shift would cross shard boundaries otherwise: pass them
    as transformers' ``shift_labels``, or take the loss from the logits), and the weights'
    gradients summed over the ranks. Sliding windows, softcap and sinks apply as on one GPU.
    Unpadded sequences only: a padding mask, packed sequences and decode steps are refused.
    """
    from ..distributed.layout import check_layout

    check_layout(layout)
    previous = dict(_CONTEXT_PARALLEL)
    _CONTEXT_PARALLEL.clear()
    _CONTEXT_PARALLEL.update(group=group, layout=layout)
    try:
        yield
    finally:
        _CONTEXT_PARALLEL.clear()
        _CONTEXT_PARALLEL.update(previous)


def context_parallel_step(query: Any, key: Any, value: Any, attention_mask: Any, dropout: float,
                          scaling: float | None, sliding_window: int | None, softcap: float | None,
                          is_causal: bool, sink: Any, kwargs: dict) -> Any:
    """One attention call inside ``context_parallel``: q (batch, seqlen_local, heads_q, d), k and v
    (batch, seqlen_local, heads_kv, d), this rank's shard. The sliding window applies whatever the
    shard's length (the gathered sequence decides, and a window wider than it changes nothing)."""
    from ..distributed import ring_attention

    _refuse_dropout(dropout)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("context parallelism takes unpadded sequences: got a padding mask with padding")
    if any(kwargs.get(k) is not None for k in VARLEN_KEYWORDS) or key.shape[1] != query.shape[1]:
        raise ValueError("context parallelism runs training and prefill on unpadded, unpacked sequences: got "
                         "packed-sequence keywords, or keys beyond the queries (a decode step on a KV cache: "
                         f"{key.shape[1]} keys, {query.shape[1]} queries)")
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    return ring_attention(query, key, value, group=_CONTEXT_PARALLEL["group"], causal=bool(is_causal),
                          softmax_scale=_scale(scaling), window_size=window, softcap=_softcap(softcap),
                          layout=_CONTEXT_PARALLEL["layout"], learnable_sink=_sink(sink))


DECODE_ROWS = 16  # query rows a sequence up to which a step runs the KV-cache kernel (0: never)
PAGED_KEYWORDS = ("block_table", "k_cache", "v_cache")  # continuous batching's: refused


def decodes(query: Any, attention_mask: Any, key: Any, value: Any, module: Any, kwargs: dict) -> bool:
    """Whether a call is a decode step that ``decode_step`` serves: at most ``DECODE_ROWS`` query
    rows a sequence, in eval mode, and either a 2-D padding mask no
    longer than the keys (transformers' dynamic cache: as long; its static cache: ours, padded
    to the keys' length) or no mask and no packing (as transformers' own test: ``cu_seq_lens_q``,
    or ``position_ids`` of one sequence of several rows, where they may restart). As in
    transformers' FlashAttention path, a mask outranks packing keywords. Head dims that run padded
    or split (``operations.head_dims``) never take it: the KV-cache call would have to copy the cache."""
    batch, rows = query.shape[0], query.shape[1]
    if rows > DECODE_ROWS or module.training or not kv_cache_native(query.shape[-1], value.shape[-1]):
        return False
    if attention_mask is None:
        positions = kwargs.get("position_ids")
        return kwargs.get("cu_seq_lens_q") is None and (batch > 1 or rows == 1 or positions is None)
    return attention_mask.dim() == 2 and attention_mask.shape[1] <= key.shape[1]


def dense(query: Any, attention_mask: Any, kwargs: dict) -> bool:
    """Whether a call that is no decode step is one dense ``flash_attention`` over the batch, as
    transformers' FlashAttention path would find it, but found without its sync in every layer:
    no padding mask, no varlen keywords, and ``position_ids`` that do not restart
    (``packed``). Under torch.compile or CUDA-graph capture, a batch of one with
    ``position_ids`` of several rows is left to transformers' path (its test reads the values)."""
    if attention_mask is not None or any(kwargs.get(k) is not None for k in VARLEN_KEYWORDS):
        return False
    return packed(kwargs.get("position_ids"), query.shape[0]) is False


VARLEN_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_LAST_POSITIONS: list = []  # [(position_ids, its version, packed)] of the last eager test


def packed(position_ids: Any, batch: int) -> bool | None:
    """transformers' test for packed sequences (``_is_packed_sequence``: a batch of one whose
    ``position_ids`` restart somewhere), once a forward rather than once a layer: every layer
    gets the same ``position_ids`` tensor, so an eager call reuses the last answer while
    ``position_ids`` is that very tensor, unchanged (``_version``; the entry holds it, so that no
    later tensor can take its memory). The test reads the values (``restarts``: one host sync,
    which waits for all the work queued before it), but where the model made them itself
    (``made_positions``); under torch.compile or CUDA-graph capture, where it cannot, returns
    None (not known)."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return False
    import torch

    if torch.compiler.is_compiling() or (position_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    reuse = not position_ids.is_inference()
    last = _LAST_POSITIONS[0] if _LAST_POSITIONS else (None, None, None)
    if reuse and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    found = False if made_positions() else restarts(position_ids)
    if reuse:
        _LAST_POSITIONS[:] = [(position_ids, position_ids._version, found)]
    return found


def restarts(position_ids: Any) -> bool:
    """Whether (1, seqlen) ``position_ids`` restart somewhere (transformers' test: they differ from
    consecutive positions from their least). Reads the device: one host sync."""
    import torch

    rows = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return bool((rows + position_ids.min() - position_ids).abs().sum())


# ------------------------------------------------------------------ position_ids a model makes

_MADE = threading.local()  # per thread: .modules, ids of the models whose running forward makes them
_FORWARD_PARAMS: dict = {}  # model class -> {parameter name: position in args} of its forward


def made_positions() -> bool:
    """Whether a forward of a model on numbaflash runs on this thread that was given neither
    ``position_ids`` nor ``cache_position``, so that it makes its position_ids itself: transformers'
    decoders take consecutive positions from the cache's length (``arange``), in which no packed
    sequence can hide, so ``packed`` need not read them (a forward pre-hook, ``track_positions``,
    counts these forwards). Models given position_ids (packed or not) have them read once a forward."""
    return bool(getattr(_MADE, "modules", None))


def track_positions(model: Any) -> None:
    """Hooks on ``model``'s forward that keep ``made_positions`` (once a model)."""
    if model.__dict__.get("_numbaflash_positions_tracked"):
        return
    model.register_forward_pre_hook(_forward_begins, with_kwargs=True)
    model.register_forward_hook(_forward_ends, with_kwargs=True, always_call=True)
    model.__dict__["_numbaflash_positions_tracked"] = True


def _forward_begins(module: Any, args: tuple, kwargs: dict) -> None:
    import torch

    if torch.compiler.is_compiling():  # not traced: the compiled path never reads the positions
        return
    params = _FORWARD_PARAMS.get(type(module))
    if params is None:
        names = tuple(inspect.signature(type(module).forward).parameters)[1:]  # after self
        params = _FORWARD_PARAMS[type(module)] = {name: i for i, name in enumerate(names)}

    def given(name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = params.get(name, len(args))
        return args[i] if i < len(args) else None

    if "position_ids" in params and given("position_ids") is None and given("cache_position") is None:
        _MADE.__dict__.setdefault("modules", []).append(id(module))


def _forward_ends(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    """(Also after a forward that raised: ``always_call``.) Only this model's own entry leaves."""
    import torch

    if torch.compiler.is_compiling():
        return
    modules = _MADE.__dict__.get("modules")
    if modules and modules[-1] == id(module):
        modules.pop()


def decode_step(q: Any, k_cache: Any, v_cache: Any, mask: Any, causal: bool, scale: float | None,
                softcap: float | None, sink: Any, window: tuple[int, int] = (-1, -1)) -> Any:
    """One decode step on the cache as transformers holds it: q (batch, seqlen_q, heads_q,
    head_dim); k_cache and v_cache (batch, slots, heads_kv, head_dim or v's), views of
    transformers' (batch, heads_kv, slots, .) buffers; ``mask`` (batch, seen) of 1 on each
    sequence's tokens, 0 on its left padding (and past its last token), or None: every slot is a
    key, as in transformers' FlashAttention path (a static cache's empty slots too: call a model
    with a static cache with its attention mask, as ``generate`` does). Sequence b's keys are
    slots cache_leftpad[b] .. cache_seqlens[b] - 1, the mask's first and past-last 1, found on
    the device (no host sync, so a CUDA graph can capture the step); a mask with a 0 between its
    1s fails a device-side assertion rather than attend to its hole. ``window``: (left, right)
    over those keys, as ``flash_attention_with_kvcache`` takes it (transformers' sliding layers
    keep their slots in token order, the static one by rolling). Returns out (batch, seqlen_q,
    heads_q, v's head dim)."""
    from .. import api

    seqlens, leftpad = cache_rows(q.shape[0], k_cache.shape[1], q.device, mask)
    return api.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=bool(causal),
                                            softmax_scale=_scale(scale), window_size=_window(window),
                                            softcap=_softcap(softcap),
                                            learnable_sink=_sink(sink), cache_leftpad=leftpad)


_LAST_MASK: list = []  # [(mask, its version, (cache_seqlens, cache_leftpad))] of the last eager call


def cache_rows(batch: int, slots: int, device: Any, mask: Any) -> tuple[Any, Any]:
    """(cache_seqlens, cache_leftpad), int32 (batch,) device tensors, of ``decode_step``: from
    ``mask`` (the first and past-last 1 of each row; a 0 between 1s fails a device-side
    assertion), or (slots for every row, None) without one. Every layer of a forward gets the
    same mask, so an eager call reuses the last call's tensors while ``mask`` is that very
    tensor, unchanged (``_version``): 7 small kernels once a step, not once a layer. The entry
    holds the mask, so that no later mask can take its memory and pass for it. Under
    torch.compile, or while a CUDA graph is captured, each call computes them."""
    import torch

    if mask is None:  # every slot is a key
        return torch.full((batch,), slots, dtype=torch.int32, device=device), None
    # not while compiling or capturing a CUDA graph: the graph must compute them from its mask
    # (a static buffer that changes between replays), not hold tensors computed before it; not
    # for inference-mode tensors, which keep no version to tell an in-place change by
    reuse = not (torch.compiler.is_compiling() or mask.is_inference()
                 or (mask.is_cuda and torch.cuda.is_current_stream_capturing()))
    if reuse and _LAST_MASK and _LAST_MASK[0][0] is mask and _LAST_MASK[0][1] == mask._version:
        return _LAST_MASK[0][2]
    ones = mask.to(torch.int32)
    leftpad = ones.argmax(dim=1).to(torch.int32)
    seqlens = (ones.shape[1] - ones.flip(1).argmax(dim=1)).to(torch.int32)
    torch._assert_async((ones.sum(dim=1) == seqlens - leftpad).all(),
                        "numbaflash's decode step needs each sequence's tokens contiguous in its mask")
    if reuse:
        _LAST_MASK[:] = [(mask, mask._version, (seqlens, leftpad))]
    return seqlens, leftpad


# ------------------------------------------------------------------ registration


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` ("numbaflash") load and run models on numbaflash in this
    process (``from_pretrained``, ``from_config``, ``set_attn_implementation``); idempotent.
    ``name`` must contain "flash", so that transformers gives it FlashAttention's masks. Returns
    the name. ImportError without transformers; RuntimeError where the installed transformers
    lacks the FlashAttention path this builds on."""
    if "flash" not in name:
        raise ValueError(f"name must contain 'flash' (transformers then builds FlashAttention's masks "
                         f"for it), got {name!r}")
    try:
        import transformers
        from transformers import AttentionInterface, PreTrainedModel
        from transformers import modeling_flash_attention_utils as fa_utils
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError("numbaflash.integrations.transformers needs transformers: "
                          "pip install numbaflash[transformers]") from error
    missing = [f"transformers.modeling_flash_attention_utils.{n}" for n in
               ("_lazy_imports", "_flash_attention_forward", "_pad_input", "_unpad_input")
               if not hasattr(fa_utils, n)]
    if not hasattr(PreTrainedModel, "_check_and_adjust_attn_implementation"):
        missing.append("PreTrainedModel._check_and_adjust_attn_implementation")
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__} lacks {', '.join(missing)}; "
                           f"numbaflash's integration was written against transformers 5")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_mask)
    if not _NAMES:
        _wrap_loader(fa_utils)
        _wrap_load_check(PreTrainedModel)
    _NAMES.add(name)
    return name


def flash_mask(batch_size: int, q_length: int, kv_length: int, *args: Any, attention_mask: Any = None,
               **kwargs: Any) -> Any:
    """The mask function ``register`` gives transformers for our names: FlashAttention's (the 2-D
    padding mask's last ``kv_length`` columns, or None where there is no padding; shorter than the
    keys with transformers' static cache, which then takes the keys it covers) but for a decode
    step (at most ``DECODE_ROWS`` query rows, ``decode_step``'s), which gets the mask padded with
    0s to the keys' length, so that every step has one mask shape (a CUDA graph needs it), and
    gets it even where it is all 1s: FlashAttention's test for that (``mask.all()`` in Python)
    would stop a compiled step there (a graph break, a host sync each token), and
    ``decode_step`` reads the mask on the device anyway. Returns (batch, columns) or None."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if q_length <= DECODE_ROWS:
        if mask.shape[1] < kv_length:
            import torch

            mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]))
        return mask
    return None if mask.shape[1] == kv_length and mask.all() else mask


def _wrap_loader(fa_utils: Any) -> None:
    """transformers' FlashAttention loader (``_lazy_imports``) gives our functions for our names."""
    original = fa_utils._lazy_imports

    def lazy_imports(implementation, *args, **kwargs):
        if isinstance(implementation, str) and implementation in _NAMES:
            return flash_attn_func, flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input
        return original(implementation, *args, **kwargs)

    fa_utils._lazy_imports = lazy_imports


def _wrap_load_check(model_class: Any) -> None:
    """transformers' load-time check of an implementation (``_check_and_adjust_attn_implementation``,
    run by ``__init__``, ``from_pretrained`` and ``set_attn_implementation``) also checks the model
    against numbaflash for our names (``check_model``), and keeps our name where a model lists
    hub kernels in ``_compatible_flash_implementations`` (gpt-oss: flash-attn 2 has no sinks;
    numbaflash has them), which transformers would put in its place. Other requests (other
    names, None, a dict of names per sub-config) go through unchanged."""
    original = model_class._check_and_adjust_attn_implementation

    def check_and_adjust(self, attn_implementation, *args, **kwargs):
        if not isinstance(attn_implementation, str) or attn_implementation not in _NAMES:
            return original(self, attn_implementation, *args, **kwargs)
        check_model(self)
        track_positions(self)
        missing = object()
        own = self.__dict__.get("_compatible_flash_implementations", missing)
        self.__dict__["_compatible_flash_implementations"] = None
        try:
            return original(self, attn_implementation, *args, **kwargs)
        finally:
            if own is missing:
                del self.__dict__["_compatible_flash_implementations"]
            else:
                self.__dict__["_compatible_flash_implementations"] = own

    model_class._check_and_adjust_attn_implementation = check_and_adjust


def check_model(model: Any) -> None:
    """A ValueError naming what numbaflash cannot run in ``model`` (a transformers model before
    or after loading): a class that does not take FlashAttention in transformers, or head dims
    that no kernel takes, not even padded (``operations.head_dims``: q/k and v head dims up to
    ``MAX_HEAD_DIM`` run on the next larger kernel, prefill and training alike; their decode steps
    take transformers' FlashAttention path instead of the KV-cache call)."""
    name = type(model).__name__
    if not getattr(model, "_supports_flash_attn", False):
        raise ValueError(f"{name} does not take FlashAttention in transformers (_supports_flash_attn is "
                         f"False), so it cannot run on numbaflash; use attn_implementation='sdpa'")
    for config in _text_configs(model.config):
        dims = head_dims(config)
        if dims is None:
            continue
        qk, v = dims
        if not runs(qk, v):
            raise ValueError(f"{name}'s attention has q/k head dim {qk} and v head dim {v}: numbaflash "
                             f"has kernels for head dims {SUPPORTED_HEAD_DIMS} and the pairs "
                             f"{ASYMMETRIC_HEAD_DIMS}, and pads other head dims to {MAX_HEAD_DIM}")


def _text_configs(config: Any) -> list:
    """The config and the sub-configs that describe attention (a multimodal model's text config)."""
    found = [config]
    for attr in ("text_config", "decoder"):
        sub = getattr(config, attr, None)
        if sub is not None and sub is not config:
            found.append(sub)
    return found


def head_dims(config: Any) -> tuple[int, int] | None:
    """(q/k head dim, v head dim) of a transformers config, None where it names neither: MLA's
    ``qk_head_dim`` (or ``qk_nope_head_dim + qk_rope_head_dim``) and ``v_head_dim``, else
    ``head_dim``, else ``hidden_size // num_attention_heads``."""
    qk = getattr(config, "qk_head_dim", None)
    if qk is None and getattr(config, "qk_nope_head_dim", None) is not None:
        qk = config.qk_nope_head_dim + (getattr(config, "qk_rope_head_dim", 0) or 0)
    if qk is None:
        qk = getattr(config, "head_dim", None)
    if qk is None:
        hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
        if not hidden or not heads:
            return None
        qk = hidden // heads
    v = getattr(config, "v_head_dim", None) or qk
    return int(qk), int(v)
