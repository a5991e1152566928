"""Attention in torch for the torch-op tests: the plain formula, whose gradients torch autograd
gives (the float64 ground truth, and the same computation in the input precision), and float64
stand-ins for the two custom ops' implementations, which the CPU tests put in place of the
kernels (``torch_ops.run_forward`` / ``run_backward``)."""

from __future__ import annotations

import math

import torch

import numbaflash


def attention_formula(q, k, v, causal=False, softmax_scale=None, dtype=torch.float64):
    """(out, lse) of ``softmax(Q Kᵀ · scale) V`` computed in ``dtype``, differentiable.

    Layouts as numbaflash's: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k,
    heads_kv, head_dim); GQA by repeating k and v; causal bottom-right aligned; rows that see no
    key give 0 (and LSE -inf) with zero gradients, never NaN. lse is (batch, heads_q, seqlen_q).
    """
    _, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qf = q.to(dtype).transpose(1, 2)
    kf = k.to(dtype).repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(sq, device=q.device)[:, None]
        visible = torch.arange(sk, device=q.device)[None, :] <= rows + (sk - sq)
        seen = visible.any(dim=-1, keepdim=True)
        s = s.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
        p = torch.softmax(s, dim=-1) * seen
        lse = torch.logsumexp(s, dim=-1).masked_fill(~seen[:, 0], float("-inf"))
    else:
        p = torch.softmax(s, dim=-1)
        lse = torch.logsumexp(s, dim=-1)
    return (p @ vf).transpose(1, 2), lse


def reference_forward(q, k, v, causal, softmax_scale):
    """What ``numbaflash::flash_attention_forward`` returns, computed in float64: out in q's
    dtype (contiguous), lse float32 (batch, heads_q, seqlen_q)."""
    with torch.no_grad():
        out, lse = attention_formula(q.detach(), k.detach(), v.detach(), causal, softmax_scale)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def reference_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    """What ``numbaflash::flash_attention_backward`` returns, computed in float64 from the saved
    out and LSE as the kernel does (P = exp(S·scale − LSE), D = rowsum(dO ∘ O),
    dS = P ∘ (dP − D)); dout must be laid out as the kernel needs it."""
    assert dout.is_contiguous() and dout.storage_offset() % 8 == 0, "dout not dense for the kernel"
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    with torch.no_grad():
        qf = q.double().transpose(1, 2)
        kf = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
        vf = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
        do = dout.double().transpose(1, 2)
        s = (qf @ kf.transpose(-1, -2)) * softmax_scale
        if causal:
            rows = torch.arange(sq, device=q.device)[:, None]
            visible = torch.arange(sk, device=q.device)[None, :] <= rows + (sk - sq)
            s = s.masked_fill(~visible, float("-inf"))
        lse64 = lse.double()[..., None]
        p = torch.where(torch.isfinite(lse64), torch.exp(s - lse64.nan_to_num(neginf=0.0)), 0.0)
        delta = (do * out.double().transpose(1, 2)).sum(-1, keepdim=True)
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ vf.transpose(-1, -2) - delta)
        dq = (ds @ kf) * softmax_scale
        dk = (ds.transpose(-1, -2) @ qf) * softmax_scale
        dk = dk.reshape(b, hkv, group, sk, d).sum(2)
        dv = dv.reshape(b, hkv, group, sk, v.shape[-1]).sum(2)  # v's head dim may differ from q's
    return tuple(g.transpose(1, 2).to(x.dtype).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))


class Block(torch.nn.Module):
    """A pre-norm transformer block for the torch.compile tests: GQA causal attention through
    numbaflash (q, k, v as views of one projection), then an MLP."""

    def __init__(self, dim, heads, kv_heads, dtype=torch.bfloat16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim, dtype=dtype), torch.nn.LayerNorm(dim, dtype=dtype)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim, dtype=dtype), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim, dtype=dtype))

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        x = x + self.proj(numbaflash.flash_attention(q, k, v, causal=True).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))
