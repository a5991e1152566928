"""numbaflash beside FlashAttention-4 (``flash-attn-4``, the CuTe-DSL FlashAttention) and SDPA's
cuDNN backend, forward and backward, in one process (needs a GPU, PyTorch with CUDA and FA4;
``../shared/device/prepare-fa4.sh`` says how FA4 reaches the GPU machine).

    python benchmarks/fa4_compare.py [--seqlens 1k,4k,16k] [--head-dims 64,128] [--dtypes bf16]
                                     [--causal both] [--tokens 65536]
    ncu --profile-from-start off ... python benchmarks/fa4_compare.py --profile 128,4096,0

The workload is ``backward_speed.py``'s: batch * seqlen = ``--tokens``, heads * head_dim = 2048,
(batch, seqlen, heads, head_dim) tensors, random normal. Forward: ``flash_attention`` against
FA4's ``flash_attn_func``; backward: ``flash_attention_backward`` (prepare, main and dQ kernels)
against FA4's backward through autograd (its preprocess, main and postprocess kernels) and
cuDNN's. Each is the median of ``--iters`` CUDA-event-timed calls in ``--rounds`` blocks
interleaved with the others' (``backward_speed.interleaved_medians``). TFLOP/s: the forward
counts 4 * batch * heads * seqlen^2 * head_dim FLOPs (half with causal masking), the backward
2.5x that. Ratios above 1: numbaflash is faster.

``--profile D,S,CAUSAL`` runs each implementation's forward and backward a few times for one
shape, then once more between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that
``ncu --profile-from-start off`` profiles exactly one call of each.
"""

from __future__ import annotations

import argparse

import torch
from backward_speed import interleaved_medians, sdpa_backward, seqlen
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash


def implementations(q, k, v, dout, causal: bool) -> dict:
    """name: (forward call, backward call) for numbaflash, FA4 and cuDNN on the same tensors."""
    from flash_attn.cute import flash_attn_func

    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    calls = {"ours": (lambda: numbaflash.flash_attention(q, k, v, causal=causal),
                      lambda: numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=causal))}
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    fa4_out = flash_attn_func(qg, kg, vg, causal=causal)[0]
    calls["fa4"] = (lambda: flash_attn_func(q, k, v, causal=causal),
                    lambda: torch.autograd.grad(fa4_out, (qg, kg, vg), dout, retain_graph=True))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn_forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa(qt, kt, vt, is_causal=causal)

    try:
        cudnn_forward()
        calls["cudnn"] = (cudnn_forward, sdpa_backward(SDPBackend.CUDNN_ATTENTION, q, k, v, dout, causal)[0])
    except RuntimeError:  # cuDNN does not take this problem: its columns read nan
        pass
    return calls


def check(q, k, v, dout, causal: bool) -> float:
    """Largest |ours - FA4| over out, dq, dk and dv, relative to max |FA4|: a guard that both
    compute the same thing before either is timed."""
    from flash_attn.cute import flash_attn_func

    worst = 0.0
    grads = []
    for fn in (lambda a, b, c: numbaflash.flash_attention(a, b, c, causal=causal),
               lambda a, b, c: flash_attn_func(a, b, c, causal=causal)[0]):
        qg, kg, vg = (x[:1].detach().requires_grad_() for x in (q, k, v))
        o = fn(qg, kg, vg)
        grads.append([o, *torch.autograd.grad(o, (qg, kg, vg), dout[:1])])
    for ours, theirs in zip(*grads, strict=True):
        worst = max(worst, ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item())
    return worst


def measure(dtype: torch.dtype, d: int, s: int, causal: bool, args: argparse.Namespace) -> str:
    """One table row: forward and backward TFLOP/s of numbaflash, FA4 and cuDNN, and the ratios."""
    b, h = max(1, args.tokens // s), 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(4))
    diff = check(q, k, v, dout, causal)
    calls = implementations(q, k, v, dout, causal)
    timed = {f"{name} {direction}": fns[i] for name, fns in calls.items()
             for i, direction in enumerate(("fwd", "bwd"))}
    ms = interleaved_medians(timed, args.warmup, args.iters, args.rounds, args.warmup_ms)
    nan = float("nan")
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    cells = []
    for direction, scale in (("fwd", 1.0), ("bwd", 2.5)):
        t = {name: ms.get(f"{name} {direction}", nan) for name in ("ours", "fa4", "cudnn")}
        cells += [f"{scale * flops / t[name] / 1e9:.0f}" for name in ("ours", "fa4", "cudnn")]
        cells += [f"{t['fa4'] / t['ours']:.3f}", f"{t['cudnn'] / t['ours']:.3f}"]
    name = "fp16" if dtype == torch.float16 else "bf16"
    return f"| {name} | {d} | {s} | {'yes' if causal else 'no'} | " + " | ".join(cells) + f" | {diff:.1e} |"


def profile(spec: str, dtype: torch.dtype, tokens: int) -> None:
    """One forward and one backward of each implementation inside the profiler's range."""
    d, s, causal = (int(x) for x in spec.split(","))
    b, h = max(1, tokens // s), 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(4))
    calls = implementations(q, k, v, dout, bool(causal))
    for forward, backward in calls.values():
        for _ in range(3):
            forward()
            backward()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for forward, backward in calls.values():
        forward()
        backward()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {', '.join(calls)} at d{d} s{s} causal={bool(causal)} batch {b} heads {h}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="1k,4k,16k")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timed block")
    p.add_argument("--warmup-ms", type=float, default=250.0, help="and at least this long of them")
    p.add_argument("--iters", type=int, default=21, help="timed calls per implementation")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed blocks per implementation")
    p.add_argument("--profile", metavar="D,S,CAUSAL", help="one call of each inside the profiler's range")
    args = p.parse_args()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if args.profile:
        profile(args.profile, dtypes[args.dtypes.split(",")[0]], args.tokens)
        return
    import flash_attn.cute as fa4

    print(f"GPU: {torch.cuda.get_device_name()}; numbaflash {numbaflash.__version__}, "
          f"torch {torch.__version__}, flash-attn-4 from {fa4.__file__}")
    print("| dtype | d | seqlen | causal | fwd ours | fwd FA4 | fwd cuDNN | fwd vs FA4 | fwd vs cuDNN "
          "| bwd ours | bwd FA4 | bwd cuDNN | bwd vs FA4 | bwd vs cuDNN | max diff |")
    print("|---|--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for dname in args.dtypes.split(","):
        for d in (int(x) for x in args.head_dims.split(",")):
            for s in (seqlen(x) for x in args.seqlens.split(",")):
                for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
                    print(measure(dtypes[dname], d, s, causal, args), flush=True)


if __name__ == "__main__":
    main()
