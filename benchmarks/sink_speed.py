"""The learnable sink's cost (issue 56): forward, backward and decode with and without a sink, and
beside FlashAttention-4's ``learnable_sink`` when ``flash_attn.cute`` imports, in one process (needs
a GPU and PyTorch with CUDA).

    python benchmarks/sink_speed.py [--seqlen 4096] [--head-dims 64,128] [--dtype bf16]
                                    [--tokens 65536] [--iters 30] [--rounds 3] [--pairs 60] [--no-fa4]

The workload is ``backward_speed.py``'s: batch * seqlen = ``--tokens``, heads * head_dim = 2048,
(batch, seqlen, heads, head_dim) tensors, random normal, a float32 sink of shape (heads,). Each
call is the median of ``--iters`` CUDA-event-timed calls in ``--rounds`` blocks interleaved with
the others' (``backward_speed.interleaved_medians``: after at least 250 ms of warm-up calls, the
blocks in alternating order), so that a clock step hits every call alike.

Per head dim and causal flag it prints the times (ms) of our forward and backward without and with
the sink, the ratios sink / plain (the issue's bar: at most 1.03 each), and, with FA4, FA4's time
with its sink over ours (above 1: ours is faster; the backward through autograd, the sink requiring
grad, where FA4 takes it). Then decode, one query a sequence against 8 sequences of 8192 cached
keys (32 query and 8 KV heads, head dim 128), with and without a sink (bar 1.03). Each ratio comes
twice: from the interleaved blocks' medians, and paired (``paired_ratio``: plain and sink calls
alternating one by one, the median and quartiles of ``--pairs`` adjacent ratios), which a clock
step between blocks cannot bias (the blocks' ratio moved by about 4% between two runs, N1129).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from backward_speed import interleaved_medians

import numbaflash


def dense_calls(q, k, v, dout, sink, causal: bool, fa4: bool) -> dict:
    """name: callable for our forward and backward, plain and with the sink, and FA4's with it."""
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    out_s, lse_s = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True, learnable_sink=sink)
    calls = {
        "fwd plain": lambda: numbaflash.flash_attention(q, k, v, causal=causal),
        "fwd sink": lambda: numbaflash.flash_attention(q, k, v, causal=causal, learnable_sink=sink),
        "bwd plain": lambda: numbaflash.flash_attention_backward(dout, q, k, v, out, lse, causal=causal),
        "bwd sink": lambda: numbaflash.flash_attention_backward(dout, q, k, v, out_s, lse_s, causal=causal,
                                                                learnable_sink=sink),
    }
    if fa4:
        from flash_attn.cute import flash_attn_func

        calls["fa4 fwd sink"] = lambda: flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
        qg, kg, vg, sg = (x.detach().requires_grad_() for x in (q, k, v, sink))
        try:
            fa4_out = flash_attn_func(qg, kg, vg, causal=causal, learnable_sink=sg)[0]
            torch.autograd.grad(fa4_out, (qg, kg, vg, sg), dout, retain_graph=True)
            calls["fa4 bwd sink"] = lambda: torch.autograd.grad(fa4_out, (qg, kg, vg, sg), dout,
                                                                retain_graph=True)
        except (AssertionError, RuntimeError, NotImplementedError) as error:  # no backward with a sink
            print(f"FA4's backward with a learnable sink did not run here: {type(error).__name__}: {error}")
    return calls


def decode_calls(dtype: torch.dtype) -> dict:
    """Decode, plain and with a sink: 8 sequences of 8192 cached keys, one query each."""
    batch, keys, heads_q, heads_kv, d = 8, 8192, 32, 8, 128
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=dtype)
    k_cache, v_cache = (torch.randn(batch, keys, heads_kv, d, device="cuda", dtype=dtype) for _ in range(2))
    lens = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
    sink = torch.randn(heads_q, device="cuda")
    return {
        "decode plain": lambda: numbaflash.flash_attention_with_kvcache(q, k_cache, v_cache, lens),
        "decode sink": lambda: numbaflash.flash_attention_with_kvcache(q, k_cache, v_cache, lens,
                                                                       learnable_sink=sink),
    }


def paired_ratio(plain, with_sink, pairs: int) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of with_sink / plain over ``pairs`` adjacent pairs
    of CUDA-event-timed calls, the two alternating call by call after the warm-up
    (``tools.bench.time_with_events``): a clock step moves both calls of a pair alike, which
    blocks of one call each cannot promise."""
    from numbaflash.tools.bench import Device, time_with_events

    times = time_with_events(Device(torch), [plain, with_sink], 5, 2 * pairs, 250.0)
    ratios = sorted(b / a for a, b in zip(times[0::2], times[1::2], strict=True))
    quartile = len(ratios) // 4
    return statistics.median(ratios), ratios[quartile], ratios[-1 - quartile]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--iters", type=int, default=30, help="timed calls per call")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed blocks per call")
    p.add_argument("--pairs", type=int, default=60, help="adjacent plain / sink pairs for the paired ratios")
    p.add_argument("--no-fa4", action="store_true", help="leave FlashAttention-4 out")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    fa4 = not args.no_fa4
    if fa4:
        try:
            import flash_attn.cute  # noqa: F401
        except ImportError:
            print("flash_attn.cute does not import here: FA4's columns are left out")
            fa4 = False
    print(f"GPU: {torch.cuda.get_device_name()}; numbaflash {numbaflash.__version__}, "
          f"torch {torch.__version__}, {args.dtype}, seqlen {args.seqlen}, {args.tokens} tokens, width 2048")
    print("| d | causal | fwd plain ms | fwd sink ms | fwd sink / plain | bwd plain ms | bwd sink ms "
          "| bwd sink / plain | FA4 fwd sink / ours | FA4 bwd sink / ours | fwd paired [q1, q3] "
          "| bwd paired [q1, q3] |")
    print("|--:|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    nan = float("nan")
    for d in (int(x) for x in args.head_dims.split(",")):
        batch, heads = max(1, args.tokens // args.seqlen), 2048 // d
        for causal in (False, True):
            q, k, v, dout = (torch.randn(batch, args.seqlen, heads, d, device="cuda", dtype=dtype)
                             for _ in range(4))
            sink = torch.randn(heads, device="cuda")
            calls = dense_calls(q, k, v, dout, sink, causal, fa4)
            ms = interleaved_medians(calls, 5, args.iters, args.rounds, 250.0)
            fa4_fwd, fa4_bwd = ms.get("fa4 fwd sink", nan), ms.get("fa4 bwd sink", nan)
            paired = [paired_ratio(calls[f"{x} plain"], calls[f"{x} sink"], args.pairs)
                      for x in ("fwd", "bwd")]
            cells = " | ".join(f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in paired)
            print(f"| {d} | {'yes' if causal else 'no'} | {ms['fwd plain']:.3f} | {ms['fwd sink']:.3f} "
                  f"| {ms['fwd sink'] / ms['fwd plain']:.3f} | {ms['bwd plain']:.3f} | {ms['bwd sink']:.3f} "
                  f"| {ms['bwd sink'] / ms['bwd plain']:.3f} | {fa4_fwd / ms['fwd sink']:.3f} "
                  f"| {fa4_bwd / ms['bwd sink']:.3f} | {cells} |", flush=True)
    calls = decode_calls(dtype)
    ms = interleaved_medians(calls, 5, args.iters * 10, args.rounds, 250.0)
    plain, with_sink = ms["decode plain"], ms["decode sink"]
    m, lo, hi = paired_ratio(calls["decode plain"], calls["decode sink"], args.pairs * 10)
    print(f"decode 8 x 8192 keys, d128, 32/8 heads: plain {1000 * plain:.1f} us, "
          f"sink {1000 * with_sink:.1f} us, sink / plain {with_sink / plain:.3f}, "
          f"paired {m:.3f} [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
