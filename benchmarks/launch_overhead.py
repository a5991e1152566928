"""Host cost of one ``flash_attention`` call, and where it goes (needs a GPU and PyTorch).

    python benchmarks/launch_overhead.py [--seqlen 4096] [--head-dim 128] [--calls 300]

Prints, for torch CUDA tensors already on the device: the host time per call while the device
is busy (the launch cost; a call that waits for the device shows up as a long one) of the
dispatched kernel and, on Hopper, of the mma.sync kernel forced (the launch path without
tensor maps), the same for torch SDPA (flash) for scale, and a cProfile of numbaflash's calls
sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash
from numbaflash.tools import bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    print(f"GPU: {torch.cuda.get_device_name(0)}; shape (B, S, H, D) = {shape}, fp16; "
          f"host ms per call, device busy, {args.calls} calls")

    def ours():
        numbaflash.flash_attention(q, k, v, out=out)

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def theirs():
        sdpa(qt, kt, vt)

    for _ in range(5):
        ours()
    device = bench.Device(torch)
    rows = [("numbaflash", bench.time_host_issue(device, [ours], args.calls))]
    if torch.cuda.get_device_capability(0)[0] == 9:  # Hopper: also the launch path without maps
        with bench.family_context("sm80", args.head_dim, False):
            for _ in range(5):
                ours()
            rows.append(("nf sm80", bench.time_host_issue(device, [ours], args.calls)))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        theirs()
        rows.append(("sdpa-flash", bench.time_host_issue(device, [theirs], args.calls)))
    for name, t in rows:
        print(f"{name:>12}: median {statistics.median(t):.4f}  min {min(t):.4f}  max {max(t):.4f}  "
              f"calls over 1 ms: {sum(x > 1 for x in t)}")

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(args.calls):
        ours()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
