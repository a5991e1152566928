"""Host cost of the torch grad path's Python, no GPU needed: ``numbaflash.flash_attention`` on CPU
tensors that require grad, the kernels stubbed (``torch_ops.run_forward`` returns empty tensors,
``prepare_backward`` does nothing), so the figure is the routing, checks and autograd wrapping
alone: through ``torch_ops.EagerAttention`` (what eager training calls take) and through the custom
op (what torch.compile and dispatch modes take), alternated, medians of one-call timings.

    python benchmarks/grad_path_host.py [--calls 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import numbaflash
from numbaflash import torch_ops, torch_route


def stub_forward(q, k, v, causal, softmax_scale, *rest):
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch_ops.run_forward = stub_forward
    torch_ops.prepare_backward = lambda *a, **kw: 0
    eager = torch_route.eager_autograd
    q = torch.randn(1, 64, 16, 128, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 64, 4, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    paths = {"EagerAttention": eager, "custom op": lambda q, needs_grad: False}
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, rule in paths.items():
            torch_route.eager_autograd = rule
            for i in range(args.calls + 100):
                start = time.perf_counter()
                numbaflash.flash_attention(q, k, v, causal=True, softmax_scale=0.088)
                if i >= 100:
                    samples[name].append(time.perf_counter() - start)
    torch_route.eager_autograd = eager
    print(f"torch {torch.__version__}; q (1, 64, 16, 128), k/v (1, 64, 4, 128) bf16 CPU, requires grad; "
          f"kernels stubbed; median of {args.rounds} x {args.calls} calls")
    for name, times in samples.items():
        print(f"{name:>16}: {statistics.median(times) * 1e6:7.1f} us a forward call")


if __name__ == "__main__":
    main()
