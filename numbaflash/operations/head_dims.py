"""Head dims with no kernel of their own, run on the next larger kernel with zero padding.

The kernels exist for ``configs.SUPPORTED_HEAD_DIMS`` (q, k and v of one head dim) and the pairs
of ``configs.ASYMMETRIC_HEAD_DIMS``. FlashAttention-2 takes every head dim up to 256 (Phi-2 and
ViT-H use 80, SigLIP 72, Stable Diffusion's UNet 40, 80 and 160). Here any other (d_qk, d_v) with
both in 1..256 runs on the kernel of D, the smallest supported head dim >= max(d_qk, d_v): q, k
and v are copied into zero-filled buffers of head dim D, and out is the first d_v columns of the
result. Zero columns change no score of QKᵀ (so the default softmax_scale stays 1/sqrt(d_qk), the
true head dim's) and no column of PV below d_v; in the backward, dout and out padded with zeros
leave D = rowsum(dout ∘ out) as it is, and dq, dk, dv are the first columns of the padded
gradients. The price: the copies (q, k, v, and dout and out in the backward) and D / max(d_qk,
d_v) more tensor-core work.

Torch tensors (autograd flows through the padding: ``torch.nn.functional.pad`` and the slice) and
numpy arrays are padded; other device arrays (CuPy, Numba) are not (the call raises: pad them to
a supported head dim with zeros, and pass ``softmax_scale=1/sqrt(d)``). The KV-cache call takes
supported head dims only: padding a cache would copy all of it every step.

Head dim 512 (q, k and v) runs split instead (``SPLIT_HEAD_DIMS``): one call of the pair (512, 256)
per half of V's columns, each on the same q and k (V's halves are views). Both calls compute the
same scores, so each half of out is exact and the LSE is either call's; the gradient is linear in
the halves: dv is the two dv halves side by side, dq and dk are the two calls' sums (each call's
D = rowsum(dout ∘ out) is its half's, and the halves' D add up to the whole), and so is a learnable
sink's gradient. The price: QKᵀ is computed twice (1.5x the forward's tensor-core work, 1.6x the
backward's), for head dims whose O would not fit a warp's registers. Torch tensors (autograd
composes the two calls) and numpy arrays are split; other device arrays raise with what to do.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..configs import ASYMMETRIC_HEAD_DIMS, DECODE_HEAD_DIM_PAIRS, SUPPORTED_HEAD_DIMS

MAX_HEAD_DIM = max(SUPPORTED_HEAD_DIMS)
_NATIVE = frozenset(SUPPORTED_HEAD_DIMS)
PADDED_KINDS = ("torch", "numpy")
# Head dims run as calls of the pair (d, part), one per ``d // part`` columns of V: 512 as (512, 256).
SPLIT_HEAD_DIMS = {512: 256}


class Split(int):
    """``padding_for``'s answer for a head dim run split (``SPLIT_HEAD_DIMS``): the width of V's
    parts."""


def native(d_qk: int, d_v: int) -> bool:
    """Whether a kernel takes head dims (d_qk, d_v) as they are."""
    return (d_qk == d_v and d_qk in _NATIVE) or (d_qk, d_v) in ASYMMETRIC_HEAD_DIMS


def kv_cache_native(d_qk: int, d_v: int) -> bool:
    """Whether the KV-cache call (the decode kernel) takes head dims (d_qk, d_v): it neither pads
    nor splits (a cache would be copied every step)."""
    return (d_qk == d_v and d_qk in _NATIVE) or (d_qk, d_v) in DECODE_HEAD_DIM_PAIRS


def runs(d_qk: int, d_v: int) -> bool:
    """Whether numbaflash runs head dims (d_qk, d_v) at all: natively, padded or split."""
    return native(d_qk, d_v) or padded_head_dim(d_qk, d_v) is not None or split_part(d_qk, d_v) is not None


def split_part(d_qk: int, d_v: int) -> int | None:
    """The width of V's parts where head dims (d_qk, d_v) run split (``SPLIT_HEAD_DIMS``), else None."""
    part = SPLIT_HEAD_DIMS.get(d_v) if d_qk == d_v else None
    return part if part is not None and (d_qk, part) in ASYMMETRIC_HEAD_DIMS else None


def padded_head_dim(d_qk: int, d_v: int) -> int | None:
    """D, the head dim of the kernel that runs (d_qk, d_v) padded; None where a kernel takes the
    dims as they are, or where none can (a dim outside 1..256: the call's checks then raise)."""
    if native(d_qk, d_v):
        return None
    if type(d_qk) is not int or type(d_v) is not int or min(d_qk, d_v) < 1 or max(d_qk, d_v) > MAX_HEAD_DIM:
        return None
    top = max(d_qk, d_v)
    return min(d for d in SUPPORTED_HEAD_DIMS if d >= top)


def padding_for(q: Any, k: Any, v: Any, kind: str, ndim: int) -> int | None:
    """D where the call on q, k and v (``ndim``-dimensional, of ``kind``) runs padded, a ``Split``
    (V's part width) where it runs split, else None (then the call's own checks take the inputs
    as they are). A few attribute reads on the common path: q's and v's last dims, equal and
    supported."""
    try:
        d_qk, d_v = q.shape[-1], v.shape[-1]
        if d_qk == d_v and d_qk in _NATIVE:
            return None
        if len(q.shape) != ndim or len(k.shape) != ndim or len(v.shape) != ndim or k.shape[-1] != d_qk:
            return None
    except (AttributeError, IndexError, TypeError):
        return None
    part = split_part(int(d_qk), int(d_v))
    if part is not None and kind in PADDED_KINDS:
        return Split(part)
    if part is not None and kind != "other":
        raise ValueError(f"head dim {d_qk} runs as calls of the pair ({d_qk}, {part}), one per {part} "
                         f"columns of v, for torch and numpy inputs only; with these device arrays call "
                         f"it on v[..., i:i + {part}] for each i and join the outputs (dq and dk of the "
                         f"backward are the calls' sums)")
    head_dim = padded_head_dim(int(d_qk), int(d_v))
    if head_dim is not None and kind == "other":  # not an array numbaflash takes: the call's TypeError
        return None
    if head_dim is not None and kind not in PADDED_KINDS:
        raise ValueError(f"head dims ({d_qk}, {d_v}) have no kernel: numbaflash runs them on the head dim "
                         f"{head_dim} kernel with zero padding for torch and numpy inputs only; pad these "
                         f"device arrays to head dim {head_dim} with zeros and pass "
                         f"softmax_scale=1/sqrt({d_qk})")
    return head_dim


def pad(x: Any, head_dim: int, kind: str) -> Any:
    """x with its last dim zero-padded to ``head_dim`` (a new array; torch: differentiable)."""
    extra = head_dim - x.shape[-1]
    if kind == "torch":
        import torch.nn.functional as F

        return F.pad(x, (0, extra))
    x = np.asarray(x)
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def parts(x: Any, part: int, kind: str) -> list:
    """x's last dim in parts of ``part`` columns: views for torch, C-contiguous copies for numpy."""
    found = [x[..., i:i + part] for i in range(0, x.shape[-1], part)]
    return found if kind == "torch" else [np.ascontiguousarray(p) for p in found]


def join(xs: list, kind: str) -> Any:
    """The arrays ``xs`` side by side along their last dim (torch: differentiable)."""
    if kind == "torch":
        import torch

        return torch.cat(xs, dim=-1)
    return np.concatenate(xs, axis=-1)


def narrow(x: Any, d: int, kind: str) -> Any:
    """The first ``d`` columns of x's last dim: a view for torch (FlashAttention-2's
    interface returns the same), a C-contiguous array for numpy."""
    if x.shape[-1] == d:
        return x
    if kind == "torch":
        return x[..., :d]
    return np.ascontiguousarray(x[..., :d])


def check_value_dim(x: Any, d_v: int, name: str) -> None:
    """``x`` (dout or out of a padded backward) must have v's head dim."""
    shape = tuple(getattr(x, "shape", ()))
    if not shape or shape[-1] != d_v:
        raise ValueError(f"{name} must have v's head dim {d_v} in its last dimension, got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")


def default_scale(softmax_scale: Any, d_qk: int) -> Any:
    """The true head dim's default scale: the padded call would take 1/sqrt(D)."""
    return 1.0 / math.sqrt(d_qk) if softmax_scale is None else softmax_scale


def deliver(result: Any, given: Any, name: str, kind: str) -> Any:
    """``result`` written into the caller's ``given`` array (checked: same shape and dtype), or
    ``result`` itself when none was given."""
    if given is None:
        return result
    if tuple(given.shape) != tuple(result.shape) or given.dtype != result.dtype:
        raise ValueError(f"{name} must have shape {tuple(result.shape)} and dtype {result.dtype}, got "
                         f"{tuple(given.shape)} and {given.dtype}")
    if kind == "torch":
        given.copy_(result)
    else:
        if not isinstance(given, np.ndarray) or not given.flags.writeable:
            raise ValueError(f"{name} must be a writeable numpy array like the inputs")
        given[...] = result
    return given
