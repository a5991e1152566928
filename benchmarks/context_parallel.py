"""Context-parallel scaling on every GPU of this machine (NCCL, one rank a GPU).

For each method (ring over the zigzag layout, the plain ring over the contiguous layout, and the
all-to-all over heads) this times forward + backward of causal attention at ``--tokens`` tokens a
GPU, as the median of CUDA-event-timed iterations after a warm-up (the slowest rank's), against
the ideal: the single-GPU time (rank 0, same process, before the rings) of forward + backward on
the gathered sequence, divided by the number of GPUs. ``--long N`` then runs one causal forward
and backward of N tokens in all over the GPUs and reports each GPU's peak memory.

    python benchmarks/context_parallel.py --tokens 32k --heads 32 --heads-kv 8 --head-dim 128
    python benchmarks/context_parallel.py --methods zigzag --long 512k

``--loopback N`` needs one GPU: it runs, one after another in this process, what each of N ranks
computes (each ring step's kernel calls, merges and gradient sums, through the same autograd
function), with each transfer replaced by a copy on this GPU; the slowest rank against the
ideal bounds what the real ring can reach, transfers left out. The Ulysses row is its one
full-length call on heads/N heads (the all-to-alls left out). ``--long`` then reports one
rank's peak memory.

    python benchmarks/context_parallel.py --loopback 2 --tokens 32k --long 512k
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _tokens(text: str) -> int:
    text = text.strip().lower()
    if text[-1] in "km":
        return int(float(text[:-1]) * (1 << 20 if text.endswith("m") else 1024))
    return int(text)


def _time(fn, iters: int, warmup: int = 2) -> float:
    """Median ms of ``fn`` over ``iters`` calls (each between barriers), the slowest rank's."""

    def slowest(ms: float) -> float:
        t = torch.tensor([ms], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    return _median_ms(fn, iters, warmup, before=dist.barrier, after=slowest)


def _worker(rank: int, world: int, init_file: str, args) -> None:
    import numbaflash
    import numbaflash.distributed as nd

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    h, hkv, d, T = args.heads, args.heads_kv, args.head_dim, args.tokens
    S = T * world
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"GPU: {torch.cuda.get_device_name(0)} x{world}; {T} tokens a GPU ({S} in all), heads {h}/{hkv}, "
        f"d{d}, bf16, causal, batch 1")
    gen = torch.Generator(device="cuda").manual_seed(rank)
    rows = {}
    if rank == 0 and not args.skip_ideal:
        q = torch.randn(1, S, h, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(1, S, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(1, S, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        dout = torch.randn(1, S, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)

        def single():
            out = numbaflash.flash_attention(q, k, v, causal=True)
            out.backward(dout)

        ideal = _median_ms(single, args.iters) / world
        del q, k, v, dout
        torch.cuda.empty_cache()
    else:
        ideal = 0.0
    t = torch.tensor([ideal], device="cuda")
    dist.broadcast(t, 0)
    ideal = t.item()
    if not args.skip_ideal:
        say(f"single GPU, {S} tokens forward + backward: {ideal * world:.2f} ms; "
            f"ideal on {world}: {ideal:.2f} ms")
    methods = {"zigzag": (nd.ring_attention, "zigzag"), "ring": (nd.ring_attention, "contiguous"),
               "ulysses": (nd.ulysses_attention, "contiguous")}
    for name in args.methods:
        fn, layout = methods[name]
        if fn is nd.ulysses_attention and (h % world or hkv % world):
            say(f"{name}: skipped (heads {h}/{hkv} not divisible by {world})")
            continue
        q = torch.randn(1, T, h, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(1, T, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(1, T, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        dout = torch.randn(1, T, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)

        def step(fn=fn, layout=layout, q=q, k=k, v=v, dout=dout):
            out = fn(q, k, v, causal=True, layout=layout)
            out.backward(dout)

        ms = _time(step, args.iters)
        rows[name] = ms
        del q, k, v, dout
        torch.cuda.empty_cache()
    if rows:
        say("\n| method | layout | ms fwd+bwd | ideal ms | % of ideal |\n|---|---|---:|---:|---:|")
        for name, ms in rows.items():
            pct = f"{100 * ideal / ms:.1f}" if ideal else "-"
            say(f"| {name} | {methods[name][1]} | {ms:.2f} | {ideal:.2f} | {pct} |")
    if args.long:
        L = args.long // world
        torch.cuda.reset_peak_memory_stats()
        q = torch.randn(1, L, h, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(1, L, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(1, L, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        dout = torch.randn(1, L, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = nd.ring_attention(q, k, v, causal=True, layout="zigzag")
        out.backward(dout)
        e.record()
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(x).all()) for x in (out, q.grad, k.grad, v.grad))
        report = torch.tensor([torch.cuda.max_memory_allocated() / 2**30, s.elapsed_time(e), float(finite)],
                              device="cuda")
        reports = [torch.zeros_like(report) for _ in range(world)]
        dist.all_gather(reports, report)
        say(f"\n{args.long} tokens causal (batch 1, {h}/{hkv} heads, d{d}) over {world} GPUs, zigzag ring, "
            "forward + backward:")
        say("| GPU | peak memory GiB | ms | finite |\n|---|---:|---:|---|")
        for r, rep in enumerate(reports):
            say(f"| {r} | {rep[0].item():.1f} | {rep[1].item():.0f} | {bool(rep[2].item())} |")
    dist.barrier()
    dist.destroy_process_group()


class _Loopback:
    """A ring of ``world`` ranks seen from ``rank``, whose transfers are copies on this GPU."""

    class _Done:
        def __init__(self, tensors):
            self.tensors = tensors

        def wait(self):
            return self.tensors

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    def send_recv(self, tensors):
        return self._Done([t.clone() for t in tensors])


def _median_ms(fn, iters: int, warmup: int = 2, before=None, after=None) -> float:
    """Median ms of CUDA-event-timed calls of ``fn`` after ``warmup`` untimed ones; ``before`` runs
    ahead of each timed call, ``after`` maps each time (e.g. to the slowest rank's)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        times.append(ms if after is None else after(ms))
    return statistics.median(times)


def loopback(args) -> None:
    import math

    import numbaflash
    from numbaflash.distributed.blocks import LocalAttention, dense_blocks
    from numbaflash.distributed.ring import _RingAttention

    world, h, hkv, d, T = args.loopback, args.heads, args.heads_kv, args.head_dim, args.tokens
    S = T * world
    print(f"GPU: {torch.cuda.get_device_name(0)}; loopback of {world} ranks, {T} tokens a rank ({S} in all), "
          f"heads {h}/{hkv}, d{d}, bf16, causal, batch 1; transfers are copies on this GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaves(seqlen, heads, heads_kv):
        make = lambda n: torch.randn(1, seqlen, n, d, device="cuda", generator=gen,  # noqa: E731
                                     dtype=torch.bfloat16).requires_grad_()
        return make(heads), make(heads_kv), make(heads_kv), torch.randn(1, seqlen, heads, d, device="cuda",
                                                                         generator=gen, dtype=torch.bfloat16)

    q, k, v, dout = leaves(S, h, hkv)
    single = _median_ms(lambda: numbaflash.flash_attention(q, k, v, causal=True).backward(dout), args.iters)
    ideal = single / world
    print(f"single GPU, {S} tokens forward + backward: {single:.2f} ms; ideal on {world}: {ideal:.2f} ms")
    del q, k, v, dout
    rows = []
    for name, layout in (("zigzag", "zigzag"), ("ring", "contiguous")):
        if name not in args.methods:
            continue
        per_rank = []
        q, k, v, dout = leaves(T, h, hkv)
        for rank in range(world):
            plans = dense_blocks(layout, S, world, rank, True, (-1, -1))
            ring = _Loopback(world, rank)

            def step(plans=plans, ring=ring, q=q, k=k, v=v, dout=dout):
                out, _ = _RingAttention.apply(q, k, v, None, ring, LocalAttention(), plans, 1 / math.sqrt(d),
                                              0.0, (1, h, T))
                out.backward(dout)

            per_rank.append(_median_ms(step, args.iters))
        rows.append((name, layout, max(per_rank), per_rank))
        del q, k, v, dout
    if "ulysses" in args.methods and h % world == 0 and hkv % world == 0:
        q, k, v, dout = leaves(S, h // world, hkv // world)
        ms = _median_ms(lambda: numbaflash.flash_attention(q, k, v, causal=True).backward(dout), args.iters)
        rows.append(("ulysses (its call only)", "contiguous", ms, [ms]))
        del q, k, v, dout
    print("\n| method | layout | slowest rank ms | ideal ms | % of ideal | each rank ms |")
    print("|---|---|---:|---:|---:|---|")
    for name, layout, ms, per_rank in rows:
        each = ", ".join(f"{x:.2f}" for x in per_rank)
        print(f"| {name} | {layout} | {ms:.2f} | {ideal:.2f} | {100 * ideal / ms:.1f} | {each} |")
    if args.long:
        torch.cuda.empty_cache()
        L = args.long // world
        torch.cuda.reset_peak_memory_stats()
        q, k, v, dout = leaves(L, h, hkv)
        plans = dense_blocks("zigzag", args.long, world, 0, True, (-1, -1))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, _ = _RingAttention.apply(q, k, v, None, _Loopback(world, 0), LocalAttention(), plans,
                                      1 / math.sqrt(d), 0.0, (1, h, L))
        out.backward(dout)
        end.record()
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(x).all()) for x in (out, q.grad, k.grad, v.grad))
        print(f"\n{args.long} tokens causal over {world} ranks (zigzag), rank 0's work: "
              f"{start.elapsed_time(end):.0f} ms, peak memory "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, finite {finite}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=_tokens, default=32 * 1024, help="tokens a GPU (32k)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--methods", type=lambda s: s.split(","), default=["zigzag", "ring", "ulysses"])
    p.add_argument("--long", type=_tokens, default=0,
                   help="also one causal forward + backward of this many tokens in all")
    p.add_argument("--skip-ideal", action="store_true")
    p.add_argument("--loopback", type=int, default=0, help="one GPU: each of this many ranks' work, in turn")
    args = p.parse_args(argv)
    if args.loopback:
        loopback(args)
        return
    world = torch.cuda.device_count()
    if world < 1:
        raise SystemExit("context_parallel.py needs CUDA GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), args), nprocs=world)


if __name__ == "__main__":
    main()
