"""Decode speed (WORK IN PROGRESS, branch wip/decode): numbaflash's ``flash_attention_with_kvcache``
beside PyTorch SDPA's flash and cuDNN backends on the same KV cache, in one process, as GB/s of K
and V read (needs a GPU and PyTorch with CUDA).

    python benchmarks/decode_speed.py [--dtypes fp16,bf16] [--paged]

The shapes are issue 34's table (GQA 32/8, head dim 128) plus batch 128 x 2048 keys at head dim
64. Every implementation is timed in 3 blocks of CUDA-event-timed calls interleaved with the
others', each block after 250 ms of untimed calls (``tools.bench``); the median over all calls.
SDPA gets the same keys as a dense (batch, heads, seqlen_k, head_dim) view with its GQA flag, and
no mask: its ``is_causal`` is top-left (query 0 would see key 0 only), while decode's causal mask
is bottom-right and, with seqlen_q rows against thousands of keys, hides a handful of keys.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numbaflash

SHAPES = [  # batch, seqlen_k, seqlen_q, heads_q, heads_kv, head_dim
    (1, 8192, 1, 32, 8, 128), (8, 8192, 1, 32, 8, 128), (32, 4096, 1, 32, 8, 128),
    (64, 32768, 1, 32, 8, 128), (8, 8192, 4, 32, 8, 128), (1, 131072, 1, 32, 8, 128),
    (128, 2048, 1, 32, 8, 64),
]
PAGE = 64


def row_calls(dtype, b, sk, sq, hq, hkv, d, paged: bool) -> dict:
    """The calls to time on one shape: ours (and paged), SDPA flash and cuDNN where they run."""
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    kc = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    vc = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    calls = {"ours": lambda: numbaflash.flash_attention_with_kvcache(q, kc, vc, lens)}
    if paged:
        n = b * sk // PAGE
        table = torch.randperm(n, device="cuda").to(torch.int32).reshape(b, sk // PAGE)
        kp = torch.empty(n, PAGE, hkv, d, device="cuda", dtype=dtype)
        vp = torch.empty_like(kp)
        kp[table.long()] = kc.reshape(b, sk // PAGE, PAGE, hkv, d)
        vp[table.long()] = vc.reshape(b, sk // PAGE, PAGE, hkv, d)
        calls["paged"] = lambda: numbaflash.flash_attention_with_kvcache(q, kp, vp, lens, block_table=table)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def sdpa_call(backend):
        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, enable_gqa=hq != hkv)
        return run

    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            sdpa_call(backend)()
            calls[label] = sdpa_call(backend)
        except RuntimeError:  # the backend does not take this problem: "-" in its column
            pass
    return calls


def main() -> None:
    from numbaflash.tools.bench import Device, round_orders, time_with_events

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--paged", action="store_true", help="also time a paged cache (page size 64, shuffled)")
    p.add_argument("--iters", type=int, default=60)
    args = p.parse_args()
    device = Device(torch)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| dtype | batch | seqlen_k | seqlen_q | d | numbaflash GB/s | paged GB/s | flash GB/s "
          "| cudnn GB/s | ours / best |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name in args.dtypes.split(","):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for b, sk, sq, hq, hkv, d in SHAPES:
            calls = row_calls(dtype, b, sk, sq, hq, hkv, d, args.paged)
            samples = {label: [] for label in calls}
            for order in round_orders(list(calls), 3):
                for label in order:
                    samples[label] += time_with_events(device, [calls[label]], 5, args.iters // 3, 250.0)
            kv_bytes = 2 * b * sk * hkv * d * torch.finfo(dtype).bits // 8
            gbs = {label: kv_bytes / statistics.median(t) / 1e6 for label, t in samples.items()}
            best = max(gbs.get("flash", 0.0), gbs.get("cudnn", 0.0))
            cells = [f"{gbs[label]:.0f}" if label in gbs else "-"
                     for label in ("ours", "paged", "flash", "cudnn")]
            print(f"| {name} | {b} | {sk} | {sq} | {d} | {' | '.join(cells)} | {gbs['ours'] / best:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
