"""Backward speed of record: numbaflash's ``flash_attention_backward`` beside PyTorch SDPA's flash
(FlashAttention-2) and cuDNN backward, and forward + backward through autograd, in one process
(needs a GPU and PyTorch with CUDA).

    python benchmarks/backward_speed.py [--seqlens 1k,4k,16k] [--head-dims 64,128]
                                        [--dtypes fp16,bf16] [--causal both] [--tokens 65536]
                                        [--heads 16:4]

Each problem keeps batch * seqlen = ``--tokens`` and heads * head_dim = 2048 (the forward bench's
workload); ``--heads Q:KV`` fixes the query and KV heads instead (GQA: SDPA with ``enable_gqa``),
e.g. ``--tokens 4096 --seqlens 4k --head-dims 128 --heads 16:4`` for a Llama-style training
step's attention. Every implementation is timed on the same random tensors: the median of ``--iters``
CUDA-event-timed calls in ``--rounds`` blocks interleaved with the other implementations', each
block after ``--warmup`` calls and ``--warmup-ms`` of them (the clocks of an H100 step down for
about a second after a heavy row, so whatever is timed first would pay for it). TFLOP/s counts
the backward as 2.5 x the forward's 4 * batch * heads * seqlen^2 * head_dim FLOPs (half with
causal masking), as FlashAttention does; forward + backward counts 3.5 x. Ratios above 1:
numbaflash is faster.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash


def seqlen(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def timed_ms(fn, warmup: int, iters: int) -> float:
    """Median of ``iters`` CUDA-event-timed calls of ``fn`` after ``warmup`` (``tools.bench``'s timer)."""
    from numbaflash.tools.bench import Device, time_with_events

    return statistics.median(time_with_events(Device(torch), [fn], warmup, iters))


def sdpa_backward(backend, q, k, v, dout, causal):
    """(backward call, forward + backward call) of SDPA with ``backend``, on (b, h, s, d) views
    (fewer KV heads than query heads: ``enable_gqa``)."""
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2)
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    with sdpa_kernel(backend):
        out = sdpa(qt, kt, vt, is_causal=causal, **gqa)

    def backward():
        torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)

    def both():
        with sdpa_kernel(backend):
            o = sdpa(qt, kt, vt, is_causal=causal, **gqa)
        torch.autograd.grad(o, (qt, kt, vt), dot)

    return backward, both


def interleaved_medians(calls: dict, warmup: int, iters: int, rounds: int, warmup_ms: float) -> dict:
    """Median milliseconds of each call of ``calls`` (name: callable), timed in ``rounds`` blocks
    of CUDA-event-timed calls, each block after ``warmup`` calls and at least ``warmup_ms`` of
    them, the blocks interleaved forwards, then backwards (``tools.bench.round_orders``), so that
    a clock step (the power limit after a heavy row) hits every implementation alike."""
    from numbaflash.tools.bench import Device, round_orders, time_with_events

    device = Device(torch)
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    samples: dict = {name: [] for name in calls}
    for r, order in enumerate(round_orders(list(calls), rounds)):
        for name in order:
            samples[name] += time_with_events(device, [calls[name]], warmup, per_round[r], warmup_ms)
    return {name: statistics.median(times) for name, times in samples.items()}


def measure(dtype: torch.dtype, d: int, s: int, causal: bool, args: argparse.Namespace) -> str:
    """One table row: numbaflash's backward and forward + backward beside SDPA flash and cuDNN."""
    b, h = max(1, args.tokens // s), 2048 // d
    h_kv = h
    if args.heads:
        h, h_kv = (int(x) for x in args.heads.split(":"))
    q, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=dtype) for _ in range(2))
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def our_both():
        o = numbaflash.flash_attention(qg, kg, vg, causal=causal)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    calls = {"ours": lambda: numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=causal),
             "ours_both": our_both}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            backward, both = sdpa_backward(backend, q, k, v, dout, causal)
            backward()
        except RuntimeError:  # this backend does not take the problem: nan in its columns
            continue
        calls[name], calls[name + "_both"] = backward, both
    ms = interleaved_medians(calls, args.warmup, args.iters, args.rounds, args.warmup_ms)
    nan = float("nan")
    ours, ours_both = ms["ours"], ms["ours_both"]
    fb, fboth, cb, cboth = (ms.get(name, nan) for name in ("flash", "flash_both", "cudnn", "cudnn_both"))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    tf = [2.5 * flops / t / 1e9 for t in (ours, fb, cb)]
    name = "fp16" if dtype == torch.float16 else "bf16"
    return (f"| {name} | {d} | {s} | {'yes' if causal else 'no'} | {tf[0]:.0f} | {tf[1]:.0f} | {tf[2]:.0f} | "
            f"{fb / ours:.3f} | {cb / ours:.3f} | {fboth / ours_both:.3f} | {cboth / ours_both:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="1k,4k,16k")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", help="Q:KV query and KV heads (GQA), e.g. 16:4 (default: 2048 / d of each)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each timed block")
    p.add_argument("--warmup-ms", type=float, default=250.0,
                   help="and at least this long of them, so that the clocks settle (default 250)")
    p.add_argument("--iters", type=int, default=21, help="timed calls per implementation")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed blocks per implementation, interleaved with the others' (default 3)")
    args = p.parse_args()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    print(f"GPU: {torch.cuda.get_device_name()}; numbaflash {numbaflash.__version__}, "
          f"torch {torch.__version__}")
    print("| dtype | d | seqlen | causal | numbaflash bwd TF/s | flash bwd | cudnn bwd | vs flash | vs cudnn "
          "| fwd+bwd vs flash | fwd+bwd vs cudnn |")
    print("|---|--:|--:|:--|--:|--:|--:|--:|--:|--:|--:|")
    for dname in args.dtypes.split(","):
        for d in (int(x) for x in args.head_dims.split(",")):
            for s in (seqlen(x) for x in args.seqlens.split(",")):
                for causal in {"no": [False], "yes": [True], "both": [False, True]}[args.causal]:
                    row = measure(dtypes[dname], d, s, causal, args)
                    print(row, flush=True)


if __name__ == "__main__":
    main()
