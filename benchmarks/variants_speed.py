"""Speed of issue 35's options beside their references, in one process (needs a GPU and PyTorch
with CUDA): packed variable-length batches, a sliding window and softcap.

    python benchmarks/variants_speed.py [--dtypes fp16,bf16] [--parts varlen,window,softcap]

- ``varlen``: 16 sequences, lengths drawn uniformly from 128 to 4096 (seed 0), head dim 128, 16
  heads, causal and not, forward, and forward + backward through autograd: ``flash_attention_varlen``
  beside SDPA on a jagged nested tensor (PyTorch routes it to FlashAttention-2's varlen kernel)
  and beside our dense calls on each sequence alone (one call a sequence, the default dispatch).
- ``window``: 32k tokens (batch 1), head dim 128, 16 heads, window (4096, 0): forward and
  forward + backward beside FlexAttention (``torch.compile``d) with the equivalent sliding-window
  block mask, and beside our dense call of the same 32k queries over 4096 keys (the window's cost
  per query; both on the GPU's own forward kernel: the Hopper kernel on an H100).
- ``softcap``: head dim 128, 4k tokens, batch 16, 16 heads, forward with softcap 30 beside the same
  call without it, both the default dispatch (on an H100 the Hopper kernel): the softcap's cost;
  and FlexAttention's (a ``tanh`` score_mod beside none, compiled), and ours against it capped.

Every implementation of a row is timed on the same tensors, in interleaved blocks
(``backward_speed.interleaved_medians``); ratios above 1: numbaflash is faster.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from backward_speed import interleaved_medians
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash

HEADS, D = 16, 128


def varlen_rows(dtype, args) -> list[str]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 4097, 16)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, HEADS, D, device="cuda", dtype=dtype) for _ in range(3))
    cu_t = torch.tensor(cu, device="cuda")
    offsets = cu_t.long()
    nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v))
    dout = torch.randn_like(q)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    ngq, ngk, ngv = (torch.nested.nested_tensor_from_jagged(x.detach(), offsets).requires_grad_()
                     for x in (q, k, v))
    ngq, ngk, ngv = (x.transpose(1, 2) for x in (ngq, ngk, ngv))
    ndout = torch.nested.nested_tensor_from_jagged(dout, offsets).transpose(1, 2)
    rows = []
    for causal in (False, True):
        pairs = sum(int(n) * (int(n) + 1) // 2 if causal else int(n) ** 2 for n in lengths)
        flops = 4 * HEADS * D * pairs
        dense = [(q[a:b][None], k[a:b][None], v[a:b][None]) for a, b in zip(cu[:-1], cu[1:], strict=True)]
        dense_g = [(tuple(x[a:b][None].detach().requires_grad_() for x in (q, k, v)), dout[a:b][None])
                   for a, b in zip(cu[:-1], cu[1:], strict=True)]

        def ours(causal=causal):
            numbaflash.flash_attention_varlen(q, k, v, cu_t, cu_t, int(lengths.max()), int(lengths.max()),
                                              causal=causal)

        def nested(causal=causal):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa(nq, nk, nv, is_causal=causal)

        def dense_default(causal=causal, dense=dense):
            for x in dense:
                numbaflash.flash_attention(*x, causal=causal)

        def ours_both(causal=causal):
            longest = int(lengths.max())
            o = numbaflash.flash_attention_varlen(qg, kg, vg, cu_t, cu_t, longest, longest, causal=causal)
            torch.autograd.grad(o, (qg, kg, vg), dout)

        def nested_both(causal=causal):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = sdpa(ngq, ngk, ngv, is_causal=causal)
            torch.autograd.grad(o, (ngq, ngk, ngv), ndout)

        def dense_both(causal=causal, dense_g=dense_g):
            for x, d in dense_g:
                o = numbaflash.flash_attention(*x, causal=causal)
                torch.autograd.grad(o, x, d)

        calls = {"ours": ours, "nested": nested, "dense": dense_default, "ours_both": ours_both,
                 "nested_both": nested_both, "dense_both": dense_both}
        if not runs(nested):
            del calls["nested"]
        if not runs(nested_both):
            del calls["nested_both"]
        ms = interleaved_medians(calls, args.warmup, args.iters, args.rounds, args.warmup_ms)
        ref = ms.get("nested", float("nan"))
        ref_both = ms.get("nested_both", float("nan"))
        rows.append(f"| varlen | {name_of(dtype)} | {'yes' if causal else 'no'} | "
                    f"{flops / ms['ours'] / 1e9:.0f} | {ms['ours']:.3f} | {ref / ms['ours']:.3f} | "
                    f"{ms['dense'] / ms['ours']:.3f} | {ms['ours_both']:.3f} | "
                    f"{ref_both / ms['ours_both']:.3f} | {ms['dense_both'] / ms['ours_both']:.3f} |")
    return rows


def window_rows(dtype, args) -> list[str]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s, left = 32768, 4096
    q, k, v, dout = (torch.randn(1, s, HEADS, D, device="cuda", dtype=dtype) for _ in range(4))
    kk, kv = (x[:, :left].contiguous() for x in (k, v))  # 4096 keys: the window's width
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2)

    def band(b, h, qi, kj):
        return (kj <= qi) & (qi - kj <= left)

    mask = create_block_mask(band, B=None, H=None, Q_LEN=s, KV_LEN=s, device="cuda")
    flex = torch.compile(flex_attention)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def ours():
        numbaflash.flash_attention(q, k, v, window_size=(left, 0))

    def ours_both():
        o = numbaflash.flash_attention(qg, kg, vg, window_size=(left, 0))
        torch.autograd.grad(o, (qg, kg, vg), dout)

    def flex_fwd():
        with torch.no_grad():
            flex(qt, kt, vt, block_mask=mask)

    def flex_both():
        o = flex(qt, kt, vt, block_mask=mask)
        torch.autograd.grad(o, (qt, kt, vt), dot)

    def dense_4k():  # the same 32k queries over 4096 keys, no mask
        numbaflash.flash_attention(q, kk, kv)

    calls = {"ours": ours, "ours_both": ours_both, "flex": flex_fwd, "flex_both": flex_both,
             "dense": dense_4k}
    if not runs(flex_both):
        del calls["flex"], calls["flex_both"]
    ms = interleaved_medians(calls, args.warmup, args.iters, args.rounds, args.warmup_ms)
    nan = float("nan")
    ms.setdefault("flex", nan)
    ms.setdefault("flex_both", nan)
    pairs = sum(min(i, left) + 1 for i in range(s))
    flops = 4 * HEADS * D * pairs
    return [f"| window | {name_of(dtype)} | fwd {flops / ms['ours'] / 1e9:.0f} TF/s, {ms['ours']:.3f} ms | "
            f"vs flex fwd {ms['flex'] / ms['ours']:.3f} | fwd+bwd {ms['ours_both']:.3f} ms, vs flex "
            f"{ms['flex_both'] / ms['ours_both']:.3f} | window / dense 4k keys "
            f"{ms['ours'] / ms['dense']:.3f} |"]


def softcap_rows(dtype, args) -> list[str]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, s, cap = 16, 4096, 30.0
    q, k, v = (torch.randn(b, s, HEADS, D, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    # Every (dtype, mask, score_mod) is a graph of its own: past dynamo's recompile limit (8) a
    # compiled function falls back to eager FlexAttention, which is no peer to time.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    flex = torch.compile(flex_attention)

    def tanh_cap(score, b, h, qi, kj):
        return cap * torch.tanh(score / cap)

    rows = []
    for causal in (False, True):
        mask = (create_block_mask(lambda b, h, qi, kj: kj <= qi, B=None, H=None, Q_LEN=s, KV_LEN=s,
                                  device="cuda") if causal else None)

        def capped(causal=causal):
            numbaflash.flash_attention(q, k, v, causal=causal, softcap=cap)

        def plain(causal=causal):
            numbaflash.flash_attention(q, k, v, causal=causal)

        def flex_capped(mask=mask):
            flex(qt, kt, vt, score_mod=tanh_cap, block_mask=mask)

        def flex_plain(mask=mask):
            flex(qt, kt, vt, block_mask=mask)

        calls = {"capped": capped, "plain": plain, "flex_capped": flex_capped, "flex_plain": flex_plain}
        if not runs(flex_capped):
            del calls["flex_capped"], calls["flex_plain"]
        with torch.no_grad():
            ms = interleaved_medians(calls, args.warmup, args.iters, args.rounds, args.warmup_ms)
        nan = float("nan")
        flex_ms, flex_plain_ms = ms.get("flex_capped", nan), ms.get("flex_plain", nan)
        rows.append(f"| softcap | {name_of(dtype)} | {'yes' if causal else 'no'} | "
                    f"capped {ms['capped']:.3f} ms | plain {ms['plain']:.3f} ms | "
                    f"cost {ms['capped'] / ms['plain'] - 1:+.1%} | FlexAttention's cost "
                    f"{flex_ms / flex_plain_ms - 1:+.1%} | capped vs flex capped "
                    f"{flex_ms / ms['capped']:.3f} |")
    return rows


def runs(fn) -> bool:
    """Whether a reference takes the problem (a failure is printed; its columns then read nan)."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as exc:  # noqa: BLE001 - any reference failure leaves our columns standing
        print(f"reference failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return False


def name_of(dtype) -> str:
    return "fp16" if dtype == torch.float16 else "bf16"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--parts", default="varlen,window,softcap")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=250.0)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    print(f"GPU: {torch.cuda.get_device_name()}; numbaflash {numbaflash.__version__}, "
          f"torch {torch.__version__}")
    print("varlen: | part | dtype | causal | ours TF/s (useful) | ours ms | vs SDPA nested (FA2 varlen) | "
          "vs our dense calls | fwd+bwd ms | fwd+bwd vs SDPA nested | fwd+bwd vs our dense calls |")
    parts = {"varlen": varlen_rows, "window": window_rows, "softcap": softcap_rows}
    for part in args.parts.split(","):
        for dname in args.dtypes.split(","):
            for row in parts[part](dtypes[dname], args):
                print(row, flush=True)


if __name__ == "__main__":
    main()
