"""flash-attn's Python interface on numbaflash: code written for FlashAttention-2's package
(``from flash_attn import flash_attn_func``) runs on numbaflash's kernels, called directly or,
after ``install()``, through its own imports.

    from numbaflash.integrations import flash_attn as fa
    out = fa.flash_attn_func(q, k, v, causal=True)      # q (batch, seqlen, heads, head_dim), CUDA

    fa.install()                                         # then, in code written for flash-attn:
    from flash_attn import flash_attn_func               # ... numbaflash's

The functions take flash-attn 2.8's arguments, defaults and return values: ``flash_attn_func``,
``flash_attn_kvpacked_func``, ``flash_attn_qkvpacked_func``, their ``varlen`` forms and
``flash_attn_with_kvcache``. What differs, each refused with a ValueError or NotImplementedError
rather than run differently: ``dropout_p`` must be 0 (numbaflash has no attention dropout),
``alibi_slopes`` must be None, and a ``block_table`` (paged KV) only reaches the KV-cache call.
``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: flash-attn returns the
probabilities only with dropout, which is 0 here. ``deterministic=True`` turns on
``torch.use_deterministic_algorithms`` for the call, which is what makes numbaflash's autograd
backward deterministic (outside torch.compile; under it, the global setting rules). Torch tensors
(autograd, torch.compile and CUDA graphs work as for ``numbaflash.flash_attention``).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
    "install", "uninstall",
]

FLASH_ATTN_VERSION = "2.8.3"  # the flash-attn interface these functions follow


def refuse_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError(f"numbaflash has no attention dropout, got dropout_p={dropout_p}: pass 0 (in a "
                         f"model, set its config's attention_dropout to 0, or train with "
                         f"attn_implementation='sdpa')")


def _refuse_alibi(alibi_slopes: Any) -> None:
    if alibi_slopes is not None:
        raise NotImplementedError("numbaflash has no ALiBi (alibi_slopes must be None)")


def scale_of(scale: Any) -> float | None:
    return None if scale is None else float(scale)


def softcap_of(softcap: Any) -> float:
    return 0.0 if softcap is None else float(softcap)


def window_of(window: Any) -> tuple[int, int]:
    left, right = window
    return int(left), int(right)


def offsets_of(cu: Any) -> Any:
    """Sequence offsets as int32, as numbaflash takes them (flash-attn requires int32 too)."""
    import torch

    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """torch's deterministic-algorithms setting on for the block when ``on`` (the forward records
    it for the backward); left alone otherwise, and under torch.compile."""
    import torch

    if not on or torch.are_deterministic_algorithms_enabled() or torch.compiler.is_compiling():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _attention(q: Any, k: Any, v: Any, dropout_p: float, softmax_scale: Any, causal: bool, window_size: Any,
               softcap: Any, alibi_slopes: Any, deterministic: bool, return_attn_probs: bool) -> Any:
    from .. import api

    refuse_dropout(dropout_p)
    _refuse_alibi(alibi_slopes)
    with _deterministic(bool(deterministic)):
        result = api.flash_attention(q, k, v, causal=bool(causal), softmax_scale=scale_of(softmax_scale),
                                     window_size=window_of(window_size), softcap=softcap_of(softcap),
                                     return_lse=bool(return_attn_probs))
    return (*result, None) if return_attn_probs else result


def _varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
            max_seqlen_k: Any, dropout_p: float, softmax_scale: Any, causal: bool, window_size: Any,
            softcap: Any, alibi_slopes: Any, deterministic: bool, return_attn_probs: bool,
            block_table: Any = None) -> Any:
    from .. import api

    refuse_dropout(dropout_p)
    _refuse_alibi(alibi_slopes)
    if block_table is not None:
        raise NotImplementedError("numbaflash's packed call takes no block_table (paged KV): use "
                                  "flash_attn_with_kvcache for a paged cache")
    with _deterministic(bool(deterministic)):
        result = api.flash_attention_varlen(q, k, v, offsets_of(cu_seqlens_q), offsets_of(cu_seqlens_k),
                                            int(max_seqlen_q), int(max_seqlen_k), causal=bool(causal),
                                            softmax_scale=scale_of(softmax_scale),
                                            window_size=window_of(window_size), softcap=softcap_of(softcap),
                                            return_lse=bool(return_attn_probs))
    return (*result, None) if return_attn_probs else result


def flash_attn_func(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Any = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Any:
    """flash-attn's ``flash_attn_func``: q (batch, seqlen_q, heads_q, head_dim), k and v (batch,
    seqlen_k, heads_kv, head_dim), one 16-bit dtype. Returns out (batch, seqlen_q, heads_q,
    head_dim), or ``(out, softmax_lse, None)`` with ``return_attn_probs`` (lse (batch, heads_q,
    seqlen_q) float32)."""
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Any, kv: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Any:
    """``flash_attn_func`` with kv (batch, seqlen_k, 2, heads_kv, head_dim): k = kv[:, :, 0] and
    v = kv[:, :, 1], read in place (no copy)."""
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Any:
    """``flash_attn_func`` with qkv (batch, seqlen, 3, heads, head_dim), read in place."""
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                           max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                           causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Any = None) -> Any:
    """flash-attn's ``flash_attn_varlen_func``: q (total_q, heads_q, head_dim), k and v (total_k,
    heads_kv, head_dim), cu_seqlens_* (batch + 1,) offsets (int32; others are converted). Returns
    out (total_q, heads_q, head_dim), or ``(out, softmax_lse, None)`` (lse (heads_q, total_q))."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)


def flash_attn_varlen_kvpacked_func(q: Any, kv: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                                    max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Any = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Any:
    """``flash_attn_varlen_func`` with kv (total_k, 2, heads_kv, head_dim), read in place."""
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv: Any, cu_seqlens: Any, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Any = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Any:
    """``flash_attn_varlen_func`` with qkv (total, 3, heads, head_dim) and one set of offsets."""
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                            rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None,
                            cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Any:
    """flash-attn's ``flash_attn_with_kvcache`` on ``numbaflash.flash_attention_with_kvcache``
    (k and v are its ``k_new`` and ``v_new``, appended in place). flash-attn's defaults, which
    differ from numbaflash's: ``causal=False``, ``rotary_interleaved=True``. ``cache_seqlens``:
    an int32 (batch,) tensor, an int (every sequence), or None (every cache row of each sequence's
    cache is a key; not with k and v, as in flash-attn). Returns out, or ``(out, softmax_lse)``."""
    import torch

    from .. import api

    _refuse_alibi(alibi_slopes)
    if cache_seqlens is None and (k is not None or v is not None):
        raise ValueError("flash_attn_with_kvcache: k and v (rows to append) need cache_seqlens, the cache's "
                         "current lengths, as in flash-attn (without it every cache row counts as filled, "
                         "and the new rows would have nowhere to go)")
    batch = q.shape[0]
    if cache_seqlens is None:  # the whole cache: its rows (or its pages' rows) a sequence
        cache_seqlens = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    elif cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)
    return api.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k_new=k, v_new=v, block_table=block_table, causal=bool(causal),
        softmax_scale=scale_of(softmax_scale), window_size=window_of(window_size),
        softcap=softcap_of(softcap), num_splits=int(num_splits), return_lse=bool(return_softmax_lse),
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=bool(rotary_interleaved))


_INSTALLED: dict[str, Any] = {}  # module name -> what sys.modules held before install()


def install() -> types.ModuleType:
    """Make ``import flash_attn`` and ``import flash_attn.flash_attn_interface`` give these
    functions (for code written against flash-attn, with or without flash-attn installed), until
    ``uninstall()``. Returns the ``flash_attn`` module put in place."""
    if _INSTALLED:
        return sys.modules["flash_attn"]
    package = types.ModuleType("flash_attn", "flash-attn's interface on numbaflash (numbaflash.integrations."
                                             "flash_attn.install)")
    package.__version__ = f"{FLASH_ATTN_VERSION}+numbaflash"
    package.__path__ = []  # a package: its submodule resolves from sys.modules
    interface = types.ModuleType("flash_attn.flash_attn_interface", package.__doc__)
    this = sys.modules[__name__]
    for name in __all__[:7]:
        setattr(package, name, getattr(this, name))
        setattr(interface, name, getattr(this, name))
    package.flash_attn_interface = interface
    for module in (package, interface):
        _INSTALLED[module.__name__] = sys.modules.get(module.__name__)
        sys.modules[module.__name__] = module
    return package


def uninstall() -> None:
    """Undo ``install()``: ``flash_attn`` is again what it was (the real package, or nothing)."""
    for name, previous in _INSTALLED.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _INSTALLED.clear()
