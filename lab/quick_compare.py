"""Quick figure of merit: numbaflash vs SDPA (flash backend = FlashAttention-2), fp16 forward,
batch*seqlen = 64k tokens, model width 2048. Median of CUDA-event-timed repeats after
warm-up, inputs rotated over several sets. Usage: python lab/quick_compare.py [d:seqlen:causal ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import numbaflash


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def median_ms(fn_list, warmup=5, repeats=30):
    for i in range(warmup):
        fn_list[i % len(fn_list)]()
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn_list[i % len(fn_list)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(specs):
    print("GPU:", torch.cuda.get_device_name(), "| torch", torch.__version__, "|", time.strftime("%Y-%m-%d"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for spec in specs:
        d, s, causal = spec.split(":")
        d, s, causal = int(d), int(s), causal in ("1", "causal", "yes", "True")
        b, h = 65536 // s, 2048 // d
        sets = [
            [torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3)] for _ in range(3)
        ]
        outs = [torch.empty_like(x[0]) for x in sets]
        ours = [
            lambda x=x, o=o, causal=causal: numbaflash.flash_attention(*x, causal=causal, out=o)
            for x, o in zip(sets, outs, strict=True)
        ]
        t0 = time.perf_counter()
        ours[0]()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        tsets = [[y.transpose(1, 2) for y in x] for x in sets]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = [lambda x=x, causal=causal: sdpa(*x, is_causal=causal) for x in tsets]
            ref_ms = median_ms(ref)
            check = sdpa(*tsets[0], is_causal=causal).transpose(1, 2)
        ms = median_ms(ours)
        err = (outs[0].float() - check.float()).abs().max().item()
        f = flops(b, h, s, d, causal)
        rows.append((d, s, causal, f / ms / 1e9, f / ref_ms / 1e9, ref_ms / ms, err, first))
    head = ("d", "seq", "causal", "ours TF/s", "FA2 TF/s", "ratio", "maxdiff", "1st call s")
    print(" ".join(f"{h:>10}" for h in head))
    for r in rows:
        d, s, c, ours, ref, ratio, err, first = r
        cells = (d, s, str(c), f"{ours:.1f}", f"{ref:.1f}", f"{ratio:.3f}", f"{err:.1e}", f"{first:.1f}")
        print(" ".join(f"{c:>10}" for c in cells))


if __name__ == "__main__":
    main(sys.argv[1:] or ["128:4096:0", "128:4096:1", "64:4096:0", "64:4096:1"])
