"""Paged decode speed (issue 58 item 2; needs a GPU and PyTorch with CUDA): device time of the
KV-cache call on a contiguous cache beside paged caches of several page sizes, with the pages
shuffled (``s``) and with the block table the identity (``i``: then the paged cache's memory is
the contiguous one's, byte for byte, so the two differ only in the lookup). CUDA-graph replays,
one process, 3 interleaved rounds; where a paged output differs from the contiguous call's (their
split counts may differ), the largest difference is printed.

    python benchmarks/paged_speed.py [--dtype bf16] [--pages 1,16,64,256] [--shapes 0,1] [--ncu]

``--ncu``: one call of each variant of the 8 x 8192 row, between cudaProfilerStart/Stop, for
``ncu --profile-from-start off``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from decode_speed import graph_times, paged_copy

import numbaflash

SHAPES = [  # batch, seqlen_k, heads_q, heads_kv, head_dim
    (1, 8192, 32, 8, 128), (8, 8192, 32, 8, 128), (32, 4096, 32, 8, 128), (1, 131072, 32, 8, 128),
    (128, 2048, 32, 8, 64),
]
ROTATION_BYTES = 300_000_000


def variants(dtype, b, sk, hq, hkv, d, pages, copies):
    calls: dict[str, list] = {}
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    for copy in range(copies):
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
        kc = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        vc = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        ref = numbaflash.flash_attention_with_kvcache(q, kc, vc, lens)
        calls.setdefault("contiguous", []).append(
            lambda q=q, kc=kc, vc=vc, out=out: numbaflash.flash_attention_with_kvcache(
                q, kc, vc, lens, out=out))
        for page in pages:
            if sk % page:
                continue
            for shuffle in (False, True):
                kp, vp, table = paged_copy(kc, vc, page, shuffle)
                got = numbaflash.flash_attention_with_kvcache(q, kp, vp, lens, block_table=table)
                if copy == 0 and not torch.equal(got, ref):
                    print(f"page {page} shuffle {shuffle}: max |paged - contiguous| "
                          f"{(got.float() - ref.float()).abs().max().item():.3g}", flush=True)
                calls.setdefault(f"p{page}{'s' if shuffle else 'i'}", []).append(
                    lambda q=q, kp=kp, vp=vp, table=table, out=out: numbaflash.flash_attention_with_kvcache(
                        q, kp, vp, lens, block_table=table, out=out))
    return calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--pages", default="1,16,64,256")
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--shapes", default="all", help="indices into SHAPES, comma separated, or all")
    p.add_argument("--compile-only", action="store_true", help="build every variant's kernels, time nothing")
    args = p.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    pages = [int(x) for x in args.pages.split(",")]
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}; {args.dtype}; device time a call (us), graph replays; "
          "pN: page size N, i = identity table, s = shuffled", flush=True)
    if args.ncu:
        calls = variants(dtype, 8, 8192, 32, 8, 128, pages, 1)
        for fns in calls.values():
            fns[0]()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for label, fns in calls.items():
            print("ncu:", label, flush=True)
            fns[0]()
            torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    for b, sk, hq, hkv, d in shapes:
        kv_bytes = 2 * b * sk * hkv * d * 2
        copies = max(1, -(-ROTATION_BYTES // kv_bytes))
        if args.compile_only:
            variants(dtype, b, sk, hq, hkv, d, pages, 1)
            continue
        calls = variants(dtype, b, sk, hq, hkv, d, pages, copies)
        samples: dict[str, list[float]] = {label: [] for label in calls}
        for r in range(3):
            for label in (list(calls) if r % 2 == 0 else list(reversed(calls))):
                samples[label] += [1000 * t for t in graph_times(calls[label], 10)]
        base = statistics.median(samples["contiguous"])
        cells = " ".join(f"{label}={statistics.median(t):.1f}({base / statistics.median(t):.2f})"
                         for label, t in samples.items())
        print(f"b{b} sk{sk} d{d} {kv_bytes / base / 1e3:.0f}GB/s: {cells}", flush=True)
        del calls
        torch.cuda.empty_cache()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
