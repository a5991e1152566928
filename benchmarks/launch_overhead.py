"""Host cost of one ``flash_attention`` call on torch CUDA tensors, for both kernel families
beside PyTorch's SDPA, in one process (needs a GPU and PyTorch).

    python benchmarks/launch_overhead.py [--calls 2000] [--head-dim 128] [--profile]

For each implementation: the wall time of ``--calls`` back-to-back calls with no sync, divided by
the number of calls (the issue-32 measure), and the median host time of one call while the device
is busy with a sleep kernel (no call waits for the device). The problem is small (batch 1, 256
queries and keys, one head) so that the device never holds the host back. ``--profile`` adds a
cProfile of numbaflash's calls, sorted by own time.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash
from numbaflash.tools import bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    hopper = torch.cuda.get_device_capability(0)[0] == 9
    print(f"GPU: {torch.cuda.get_device_name(0)}; (B, S, H) = (1, {args.seqlen}, 1), fp16, causal; "
          f"{args.calls} calls each; numbaflash {numbaflash.__version__}, torch {torch.__version__}")
    device = bench.Device(torch)
    rows = []

    def measure(name, call):
        rows.append((name, *bench.host_cost_us(device, call, args.calls)))

    # Each family at a head dim it runs without a forced config (the hot path a user gets):
    # on Hopper the sm90 kernel at --head-dim and the sm80 kernel at 32 (Hopper's own kernel
    # lacks d32); elsewhere the sm80 kernel at --head-dim.
    dims = {"sm90": args.head_dim, "sm80": 32} if hopper else {"sm80": args.head_dim}
    profiled = None
    for family, d in dims.items():
        q, k, v = (torch.randn((1, args.seqlen, 1, d), device="cuda", dtype=torch.float16) for _ in range(3))
        out = torch.empty_like(q)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def ours(q=q, k=k, v=v):
            numbaflash.flash_attention(q, k, v, causal=True)

        def ours_out(q=q, k=k, v=v, out=out):
            numbaflash.flash_attention(q, k, v, causal=True, out=out)

        def theirs(qt=qt, kt=kt, vt=vt):
            sdpa(qt, kt, vt, is_causal=True)

        profiled = profiled or ours
        measure(f"numbaflash {family} d{d}", ours)
        measure(f"numbaflash {family} d{d} out=", ours_out)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            measure(f"sdpa flash d{d}", theirs)
    print(f"{'implementation':<26} {'back-to-back us/call':>21} {'one call, device busy, us':>26}")
    for name, wall, busy in rows:
        print(f"{name:<26} {wall:>21.1f} {busy:>26.1f}")

    if args.profile:
        print(bench.profile_calls(device, profiled, args.calls))


if __name__ == "__main__":
    main()
