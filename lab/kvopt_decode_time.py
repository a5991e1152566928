"""Probe (issue 56 item 4): the cost of the KV-cache call's options in a decode step, same process,
torch CUDA tensors, each call captured in a CUDA graph (the serving path).

    python lab/kvopt_decode_time.py [--batch 8] [--keys 8192] [--head-dim 128] [--repeats 200]

One decode step (seqlen_q 1, one new row appended, GQA 32 / 8 query / KV heads, bfloat16, causal)
against caches of ``--keys`` rows, the cache lengths at keys - 1 (so the append stays inside
the cache; reset before each replay is not needed: the lengths are not advanced): plain, with
cache_batch_idx (the rows reversed), with cache_leftpad (0 for every sequence: the same keys),
both, and the rotary embedding (halves and interleaved, rotary_dim = head_dim) with and without
the other two. Median time of a graph replay (CUDA events over ``--repeats`` replays, five
rounds); prints each option's ratio to plain. The issue's bars: cache_batch_idx and
cache_leftpad at most 1.02, rotary at most 1.05, at batch 8 with 8k keys.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    import torch

    import numbaflash

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    batch, keys, d = args.batch, args.keys, args.head_dim
    dtype = torch.bfloat16
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=dtype)
    k_cache, v_cache = (torch.randn(batch, keys, 8, d, device="cuda", dtype=dtype) for _ in range(2))
    k_new, v_new = (torch.randn(batch, 1, 8, d, device="cuda", dtype=dtype) for _ in range(2))
    lens = torch.full((batch,), keys - 1, dtype=torch.int32, device="cuda")
    idx = torch.arange(batch - 1, -1, -1, dtype=torch.int32, device="cuda")
    pad = torch.zeros(batch, dtype=torch.int32, device="cuda")
    angle = torch.arange(keys + 1, device="cuda")[:, None] / 10000.0 ** (
        torch.arange(d // 2, device="cuda") * 2 / d)[None, :]
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    rope = {"rotary_cos": cos, "rotary_sin": sin}
    variants = {
        "plain": {}, "cache_batch_idx": {"cache_batch_idx": idx}, "cache_leftpad": {"cache_leftpad": pad},
        "both": {"cache_batch_idx": idx, "cache_leftpad": pad}, "rotary": rope,
        "rotary_interleaved": {**rope, "rotary_interleaved": True},
        "rotary+both": {**rope, "cache_batch_idx": idx, "cache_leftpad": pad},
    }
    out = torch.empty_like(q)
    times = {}
    for label, extra in variants.items():
        def step(extra=extra):
            numbaflash.flash_attention_with_kvcache(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new,
                                                    out=out, **extra)

        for _ in range(3):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        rounds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) * 1000 / args.repeats)
        times[label] = statistics.median(rounds)
    for label, t in times.items():
        print(f"batch {batch} keys {keys} d{d} {label:20s} {t:8.2f} us  x{t / times['plain']:.3f}")


if __name__ == "__main__":
    main()
