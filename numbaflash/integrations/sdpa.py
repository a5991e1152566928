"""``torch.nn.functional.scaled_dot_product_attention`` on numbaflash where the call is one that
numbaflash's kernels compute exactly, and on torch's own SDPA otherwise: models that call SDPA
(diffusers' UNets and transformers, timm's ViTs, transformers' ``attn_implementation="sdpa"``)
run on numbaflash with one line.

    from numbaflash.integrations import sdpa
    with sdpa.patched():            # or sdpa.install() ... sdpa.uninstall()
        image = pipeline(prompt)    # every F.scaled_dot_product_attention call inside

A call runs on ``numbaflash.flash_attention`` when all of these hold, else it goes to torch's SDPA
unchanged (``routes`` says which):

- query, key and value are 4-D (batch, heads, seqlen, head_dim) CUDA tensors of one 16-bit dtype,
  each with a contiguous head dim and rows on 16-byte boundaries (what the kernels read in place);
- no ``attn_mask`` and ``dropout_p == 0`` (numbaflash has neither);
- ``is_causal`` only where seqlen_q == seqlen_k: SDPA's causal mask is aligned top-left (query i
  sees keys j <= i), FlashAttention's bottom-right; they agree on square problems only;
- as many query heads as key/value heads, or with ``enable_gqa`` a multiple of them;
- q's and k's head dim up to 256 (other than numbaflash's kernels' dims: padded,
  ``operations.head_dims``), v's where a kernel takes the pair or up to 256 padded; or q, k and v
  all at 512 (run in halves of v, ``operations.head_dims``).

The result is numbaflash's output transposed back to SDPA's layout (a view); autograd,
torch.compile and CUDA graphs work as for ``numbaflash.flash_attention``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..operations.head_dims import runs

__all__ = ["scaled_dot_product_attention", "routes", "patched", "install", "uninstall"]

_TORCH_SDPA: list = []  # [torch's own scaled_dot_product_attention], kept by install()


def _dtypes() -> tuple:
    import torch

    return (torch.float16, torch.bfloat16)


def _on_gpu(t: Any) -> bool:
    return bool(t.is_cuda)


def _layout_ok(t: Any) -> bool:
    """What the kernels read in place: a contiguous head dim, rows on 16-byte boundaries (strides
    and the storage offset multiples of 8 elements of 2 bytes; torch's allocations are aligned
    further)."""
    strides = t.stride()
    return strides[-1] == 1 and all(s % 8 == 0 for s in strides[:-1]) and t.storage_offset() % 8 == 0


def routes(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
           is_causal: bool = False, enable_gqa: bool = False) -> bool:
    """Whether ``scaled_dot_product_attention`` runs this call on numbaflash (the module's rules)."""
    import torch

    tensors = (query, key, value)
    if attn_mask is not None or dropout_p or not all(type(t) is torch.Tensor for t in tensors):
        return False
    if any(t.dim() != 4 or t.is_nested or not _on_gpu(t) or not _layout_ok(t) for t in tensors):
        return False
    if query.dtype not in _dtypes() or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    batch, heads_q, seqlen_q, d = query.shape
    _, heads_kv, seqlen_k, d_k = key.shape
    if value.shape[:3] != key.shape[:3] or key.shape[0] != batch or d_k != d or min(seqlen_q, seqlen_k) < 1:
        return False
    if heads_q != heads_kv and not (enable_gqa and heads_q % heads_kv == 0):
        return False
    if is_causal and seqlen_q != seqlen_k:
        return False
    return runs(d, value.shape[3])


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Any:
    """torch's ``scaled_dot_product_attention`` (same arguments and result): on numbaflash where
    ``routes`` says so, else on torch's own."""
    if routes(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        from .. import api

        scale = None if scale is None else float(scale)
        out = api.flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  causal=bool(is_causal), softmax_scale=scale)
        return out.transpose(1, 2)
    extra = {"enable_gqa": True} if enable_gqa else {}  # (older torch has no enable_gqa)
    return _torch_sdpa()(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, **extra)


def _torch_sdpa() -> Any:
    if _TORCH_SDPA:
        return _TORCH_SDPA[0]
    import torch.nn.functional as F

    return F.scaled_dot_product_attention


def install() -> None:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` with ours, process-wide, until
    ``uninstall()``. Code that looks the function up when it calls (``F.scaled_dot_product_attention``,
    as diffusers, transformers and timm do) gets ours; a reference taken before (``from
    torch.nn.functional import scaled_dot_product_attention`` at import) keeps torch's."""
    import torch.nn.functional as F

    if _TORCH_SDPA:
        return
    _TORCH_SDPA.append(F.scaled_dot_product_attention)
    F.scaled_dot_product_attention = scaled_dot_product_attention


def uninstall() -> None:
    """Put torch's own ``scaled_dot_product_attention`` back."""
    import torch.nn.functional as F

    if _TORCH_SDPA:
        F.scaled_dot_product_attention = _TORCH_SDPA.pop()


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """``install()`` for the block, then ``uninstall()`` (nothing to undo if it was installed)."""
    already = bool(_TORCH_SDPA)
    install()
    try:
        yield
    finally:
        if not already:
            uninstall()
