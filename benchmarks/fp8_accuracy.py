"""Accuracy that FP8 (e4m3) attention can reach, FlashAttention-3's experiment, on the CPU: RMSE
against float64 attention of the original inputs, for inputs drawn from N(0, 1) with a fraction of
outlier entries of a larger scale, quantized by ``numbaflash.fp8.quantize`` and run through
``numbaflash.fp8.attention_reference`` (what an FP8 kernel computes: dequantized fp32 operands,
P rounded to e4m3 before P·V). FlashAttention-3 reports 2.4e-2 for plain per-tensor FP8, 9.1e-3
with block quantization and incoherent processing, and 1.9e-4 for FP16.

    python benchmarks/fp8_accuracy.py [--seqlen 1024] [--heads 8] [--head-dim 128] [--outlier-std 10]
                                      [--kernel]

``--kernel`` (a Hopper GPU) adds a column: numbaflash's e4m3 forward on the same quantized inputs
(the scales it takes: one per (batch, KV head); q and k rotated where the row says Hadamard), and
its bf16 forward on the bf16 inputs.
"""

from __future__ import annotations

import argparse
import math

import torch

from numbaflash import fp8


def _reference(q, k, v):
    qd, kd, vd = q.double(), k.double(), v.double()
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vd)


def _rmse(a, b) -> float:
    return math.sqrt(float(((a - b) ** 2).mean()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--outliers", type=float, default=1e-3, help="fraction of outlier entries (0.1%%)")
    p.add_argument("--outlier-std", type=float, default=10.0)
    p.add_argument("--block", type=int, default=64, help="tokens a scale block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", action="store_true", help="also run numbaflash's kernels (a Hopper GPU)")
    args = p.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)

    def sample():
        x = torch.randn(shape, generator=g)
        mask = torch.rand(shape, generator=g) < args.outliers
        return torch.where(mask, torch.randn(shape, generator=g) * args.outlier_std, x)

    q, k, v = sample(), sample(), sample()
    ref = _reference(q, k, v)
    rows = []

    def kernel(x: fp8.Quantized | None, dtype=None) -> float | None:
        """RMSE of numbaflash's e4m3 kernel on ``x`` (or its ``dtype`` kernel on the inputs)."""
        if not args.kernel or (x is not None and x.block is not None):
            return None
        import numbaflash as nf

        if x is None:
            out = nf.flash_attention(*(t.to(dtype).cuda() for t in (q, k, v)))
        else:
            out = nf.flash_attention(x.q.cuda(), x.k.cuda(), x.v.cuda(), q_descale=x.q_descale.cuda(),
                                     k_descale=x.k_descale.cuda(), v_descale=x.v_descale.cuda())
        return _rmse(out.double().cpu(), ref)

    for dtype in (torch.float16, torch.bfloat16):
        rows.append((f"{str(dtype).split('.')[1]} inputs (exact math)",
                     _rmse(_reference(q.to(dtype), k.to(dtype), v.to(dtype)), ref), kernel(None, dtype)))
    # plain: one scale per whole tensor
    whole = fp8.quantize(q.reshape(1, -1, 1, args.head_dim), k.reshape(1, -1, 1, args.head_dim),
                         v.reshape(1, -1, 1, args.head_dim))
    per_head = lambda d: d.reshape(1, 1).expand(args.batch, args.heads).contiguous()  # noqa: E731
    plain = fp8.Quantized(whole.q.reshape(shape), whole.k.reshape(shape), whole.v.reshape(shape),
                          per_head(whole.q_descale), per_head(whole.k_descale), per_head(whole.v_descale),
                          None, None)
    rows.append(("FP8, one scale a tensor (plain)", _rmse(fp8.attention_reference(plain), ref),
                 kernel(plain)))
    for label, kw in (("FP8, a scale per (batch, head)", {}),
                      (f"FP8, a scale per {args.block} tokens", {"block": args.block}),
                      ("FP8, per head + Hadamard", {"hadamard": True}),
                      (f"FP8, per {args.block} tokens + Hadamard",
                       {"block": args.block, "hadamard": True})):
        quant = fp8.quantize(q, k, v, seed=args.seed, **kw)
        rows.append((label, _rmse(fp8.attention_reference(quant), ref), kernel(quant)))
        if not kw:
            rows.append((label + ", P not rounded", _rmse(fp8.attention_reference(quant, p_fp8=False), ref),
                         None))
    print(f"RMSE against float64; {shape} (batch, seqlen, heads, head_dim); N(0, 1) with "
          f"{100 * args.outliers:g}% of entries N(0, {args.outlier_std:g}^2); seed {args.seed}; "
          f"torch {torch.__version__}")
    if args.kernel:
        print(f"kernel column: numbaflash on {torch.cuda.get_device_name()}")
        print("| inputs | RMSE (reference) | RMSE (kernel) |\n|:--|--:|--:|")
    else:
        print("| inputs | RMSE |\n|:--|--:|")
    for label, err, got in rows:
        if args.kernel:
            print(f"| {label} | {err:.2e} | {'' if got is None else f'{got:.2e}'} |")
        else:
            print(f"| {label} | {err:.2e} |")


if __name__ == "__main__":
    main()
