"""FP8 (e4m3) quantization of attention inputs, FlashAttention-3's recipe: a scale per (batch, KV
head), or per block of tokens, and optionally a random Hadamard rotation of q and k (incoherent
processing: it spreads an outlier feature over the whole head dim and leaves QKᵀ unchanged).

``quantize`` gives the e4m3 tensors and float32 *descales* (x ≈ x8 · descale) in the layout of
FlashAttention-3's FP8 API (``q_descale``, ``k_descale``, ``v_descale`` of shape (batch,
heads_kv); q's heads share their KV head's scale). ``attention_reference`` computes attention from
them as an FP8 kernel does (fp32 products of the dequantized operands, P rounded to e4m3 before
P·V), in float64 elsewhere: the accuracy an FP8 kernel can reach, for the docs and the tests.

Importing this module imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass
class Quantized:
    """e4m3 q, k, v (the inputs' shapes) and float32 descales: (batch, heads_kv), or (batch,
    heads_kv, blocks) with ``block`` tokens a block (the last block may be shorter)."""
    q: Tensor
    k: Tensor
    v: Tensor
    q_descale: Tensor
    k_descale: Tensor
    v_descale: Tensor
    block: int | None
    rotation: Tensor | None  # (head_dim, head_dim) orthogonal: q and k were multiplied by it

    def dequantize(self) -> tuple[Tensor, Tensor, Tensor]:
        """float32 q, k, v as the kernel sees them (x8 · descale), rotated where q and k were."""
        heads_q, heads_kv = self.q.shape[2], self.k.shape[2]
        return (_scale_up(self.q, self.q_descale, self.block, heads_q // heads_kv),
                _scale_up(self.k, self.k_descale, self.block, 1),
                _scale_up(self.v, self.v_descale, self.block, 1))


def hadamard(n: int, seed: int = 0, device=None) -> Tensor:
    """A random orthogonal (n, n) float32 matrix H·diag(s)/sqrt(n): Sylvester's Hadamard matrix
    with random column signs; n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a head dim that is a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (h * signs[None, :] / math.sqrt(n)).to(device=device, dtype=torch.float32)


def _blocks(x: Tensor, block: int | None) -> Tensor:
    """x (batch, seqlen, heads, d) as (batch, heads, blocks, rows, d), zero-padded."""
    b, s, h, d = x.shape
    rows = s if block is None else block
    nblocks = max(1, math.ceil(s / rows))
    padded = torch.zeros(b, nblocks * rows, h, d, dtype=x.dtype, device=x.device)
    padded[:, :s] = x
    return padded.view(b, nblocks, rows, h, d).permute(0, 3, 1, 2, 4)


def _amax(x: Tensor, block: int | None, group: int) -> Tensor:
    """The largest |x| per (batch, heads / group, block): (batch, heads_kv, blocks) float32."""
    a = _blocks(x.float().abs(), block).amax(dim=(3, 4))  # (b, h, blocks)
    b, h, n = a.shape
    return a.view(b, h // group, group, n).amax(dim=2)


def _scale_up(x8: Tensor, descale: Tensor, block: int | None, group: int) -> Tensor:
    """float32 x8 · descale, the descale broadcast over its (batch, head group, block)."""
    b, s, h, d = x8.shape
    per = descale if descale.dim() == 3 else descale[..., None]  # (b, hkv, blocks)
    per = per.repeat_interleave(group, dim=1)  # (b, h, blocks)
    rows = s if block is None else block
    per = per.repeat_interleave(rows, dim=2)[:, :, :s]  # (b, h, s)
    return x8.float() * per.transpose(1, 2)[..., None]


def _quantize(x: Tensor, block: int | None, group: int) -> tuple[Tensor, Tensor]:
    amax = _amax(x, block, group)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = x.float() / _scale_up(torch.ones_like(x, dtype=torch.float32), descale, block, group)
    x8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, (descale if block is not None else descale[..., 0]).contiguous()


_random_hadamard = hadamard  # (``quantize``'s option of that name hides the function there)


def quantize(q: Tensor, k: Tensor, v: Tensor, *, block: int | None = None, hadamard: bool = False,
             seed: int = 0, hadamard_rotation: bool | None = None) -> Quantized:
    """e4m3 q, k, v and their descales.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim);
            any floating dtype, heads_q a multiple of heads_kv.
        block: None (one scale per batch and KV head: FlashAttention-3's descale shape (batch,
            heads_kv)) or tokens per scale block (descales (batch, heads_kv, blocks)).
        hadamard: rotate q and k by ``hadamard(head_dim, seed)`` first (head_dim a power of two).
            QKᵀ is unchanged; v and the output are not rotated. (``hadamard_rotation``: the same
            option under its earlier name.)
        seed: the rotation's random signs.

    Returns:
        ``Quantized``: x ≈ x8 · descale (the rotated x for q and k).
    """
    if hadamard_rotation is not None:
        hadamard = hadamard_rotation
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating torch.Tensor (batch, seqlen, heads, head_dim), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k and v must share batch (and q, k head_dim), k and v seqlen and heads; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be None or a positive int, got {block!r}")
    rotation = None
    if hadamard:
        rotation = _random_hadamard(q.shape[3], seed, q.device)
        q, k = q.float() @ rotation, k.float() @ rotation
    group = q.shape[2] // k.shape[2]
    q8, qd = _quantize(q, block, group)
    k8, kd = _quantize(k, block, 1)
    v8, vd = _quantize(v, block, 1)
    return Quantized(q8, k8, v8, qd, kd, vd, block, rotation)


P_SCALE = 256.0  # P·256 in [0, 256] before the cast: a power of two, so exact, and no underflow of
# small probabilities (FlashAttention-3/4's static scale; e4m3's normals start at 2^-6)


def attention_reference(quantized: Quantized, causal: bool = False, softmax_scale: float | None = None,
                        p_fp8: bool = True) -> Tensor:
    """float64 (batch, seqlen_q, heads_q, head_dim) attention of the dequantized inputs, with P
    rounded to e4m3 before P·V as an FP8 kernel does (``p_fp8``: P = exp(S - rowmax) in [0, 1],
    times ``P_SCALE`` for the cast; the row sum taken before the rounding). Bottom-right causal
    alignment."""
    q, k, v = (x.double() for x in quantized.dequantize())
    heads_q = q.shape[2]
    k = k.repeat_interleave(heads_q // k.shape[2], dim=2)
    v = v.repeat_interleave(heads_q // v.shape[2], dim=2)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    total = p.sum(dim=-1, keepdim=True)
    if p_fp8:
        p = (p * P_SCALE).float().to(torch.float8_e4m3fn).double() / P_SCALE
    return torch.einsum("bhqk,bkhd->bqhd", p / total, v)
