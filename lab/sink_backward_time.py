"""Probe (issue 56): the cost of a learnable sink in the backward, same process, torch CUDA tensors.

    python lab/sink_backward_time.py [--seqlen 4096] [--head-dims 64,128] [--repeats 50]

For each head dim and causal flag: median time (CUDA events) of ``flash_attention_backward``
without a sink and with one (the prepare kernel's sink build adds d_sink; the main and dQ kernels
are the plain ones), on batch·seqlen = 16k tokens, width 2048, bfloat16. Prints the ratio; the
issue's bar is at most 1.03.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    import torch

    import numbaflash

    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    for head_dim in map(int, args.head_dims.split(",")):
        heads, batch = 2048 // head_dim, max(1, 16384 // args.seqlen)
        for causal in (False, True):
            q, k, v, dout = (torch.randn(batch, args.seqlen, heads, head_dim, device="cuda",
                                         dtype=torch.bfloat16) for _ in range(4))
            sink = torch.randn(heads, device="cuda")
            times = {}
            for label, extra in (("plain", {}), ("sink", {"learnable_sink": sink})):
                out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True, **extra)

                def step(tensors=(dout, q, k, v, out, lse), causal=causal, extra=extra):
                    numbaflash.flash_attention_backward(*tensors, causal=causal, **extra)

                for _ in range(5):
                    step()
                found = []
                for _ in range(args.repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    found.append(start.elapsed_time(end))
                times[label] = statistics.median(found)
            print(f"d{head_dim} causal={causal} seqlen={args.seqlen} batch={batch}: "
                  f"plain {times['plain']:.3f} ms, sink {times['sink']:.3f} ms, "
                  f"ratio {times['sink'] / times['plain']:.3f}", flush=True)


if __name__ == "__main__":
    main()
