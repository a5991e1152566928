"""Host cost of one backward call on torch CUDA tensors (needs a GPU and PyTorch): the checked
entry (``operations.entry.direct_flash_attention_backward``), the custom op
(``torch.ops.numbaflash.flash_attention_backward``) and autograd's backward
(``torch.autograd.grad`` over ``numbaflash.flash_attention``'s output).

    python benchmarks/backward_host.py [--seqlen 4096] [--heads 16] [--kv-heads 4] [--head-dim 128]
                                       [--calls 200] [--profile]

Each figure is the median host time of one call, in microseconds: the device is synchronised
before each call and the clock stops when the call returns (the launches are asynchronous), so
the device's time never counts. Where the backward has plans (``backward.run_torch``) the entry
is also timed with them turned off ("entry, full path"): the figure of a build without them, so
that one run gives before and after; run it on an older build for its own figures. ``--profile``
adds a cProfile of the entry's calls, sorted by own time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import numbaflash
from numbaflash.operations import backward, entry


def median_us(call, calls: int, before=None) -> float:
    """Median host microseconds of ``call()`` over ``calls`` calls after 10 untimed ones, the device
    idle at each start (``before(i)``, untimed, runs first: autograd's graphs are made there)."""
    times = []
    for i in range(calls + 10):
        if before is not None:
            before(i)
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        if i >= 10:
            times.append(elapsed * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    shape_q = (1, args.seqlen, args.heads, args.head_dim)
    shape_k = (1, args.seqlen, args.kv_heads, args.head_dim)
    print(f"GPU: {torch.cuda.get_device_name(0)}; q {shape_q}, k/v {shape_k}, bf16, causal; median of "
          f"{args.calls} calls; numbaflash {numbaflash.__version__}, torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16)
               for s in (shape_q, shape_k, shape_k))
    out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    scale = args.head_dim ** -0.5
    rows = []

    def direct():
        entry.direct_flash_attention_backward(dout, q, k, v, out, lse, True, scale, False, None, None, None)

    def op():
        torch.ops.numbaflash.flash_attention_backward(dout, q, k, v, out, lse, True, scale, False)

    rows.append(("entry", median_us(direct, args.calls)))
    planned = getattr(backward, "run_torch", None)
    if planned is not None:
        backward.run_torch = lambda *a: None  # every call takes the full path
        try:
            rows.append(("entry, full path", median_us(direct, args.calls)))
        finally:
            backward.run_torch = planned
    rows.append(("custom op", median_us(op, args.calls)))

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    graph = []

    def forward(i):
        graph[:] = [numbaflash.flash_attention(*leaves, causal=True, softmax_scale=scale)]

    def grad():
        torch.autograd.grad(graph[0], leaves, dout)

    rows.append(("autograd backward", median_us(grad, args.calls, forward)))
    for name, us in rows:
        print(f"{name:>20}: {us:8.1f} us a call")
    if args.profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(args.calls):
            direct()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())


if __name__ == "__main__":
    main()
