"""Context-parallel cases run in spawned processes (gloo on the CPU, NCCL on GPUs): each rank
shards one random sequence, runs the sharded attention forward and backward, and compares its
rows with the single-device attention on the gathered sequence.

``ReferenceAttention`` is the float64 stand-in for the single-GPU kernels on the CPU: out and LSE
from the masked formula, the backward from the *given* out and LSE as the kernels do it
(P = exp(S - LSE), D = rowsum(dO * O), dS = P * (dP - D)), windows and softcap included.
"""

from __future__ import annotations

import math
import os
from functools import partial
from itertools import pairwise, product

import torch
import torch.distributed as dist


def _mask(sq: int, sk: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """FlashAttention's rule, bottom-right aligned: (sq, sk) bool, True where visible."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    left, right = window
    if causal:
        right = 0
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    return m


def _scores(q, k, scale, softcap):
    """(raw, s): QKᵀ·scale and the capped scores, (b, h, sq, sk) float64."""
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return raw, (softcap * torch.tanh(raw / softcap) if softcap > 0 else raw)


def _expand(x, heads):
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def reference(q, k, v, causal, scale, window, softcap):
    """(out, lse) float64 of the masked attention; rows that see nothing: out 0, lse -inf."""
    q, k, v = q.double(), _expand(k.double(), q.shape[2]), _expand(v.double(), q.shape[2])
    _, s = _scores(q, k, scale, softcap)
    m = _mask(q.shape[1], k.shape[1], causal, window, q.device)
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


class ReferenceAttention:
    """numbaflash's ``LocalAttention`` interface, in float64 on any device."""

    calls = 0

    def check(self, q, k, v):
        pass

    def forward(self, q, k, v, causal, scale, window, softcap, sink=None):
        ReferenceAttention.calls += 1
        out, lse = reference(q, k, v, causal, scale, window, softcap)
        if sink is not None:  # as the kernel: folded in before the one rounding of out
            folded = torch.logaddexp(lse, sink.double()[:, None])
            out = out * torch.exp(lse - folded).transpose(1, 2)[..., None]
            lse = folded
        return out.to(q.dtype), lse.to(torch.promote_types(q.dtype, torch.float32))

    def backward(self, dout, q, k, v, out, lse, causal, scale, window, softcap):
        hq, hkv = q.shape[2], k.shape[2]
        qd, kd, vd = q.double(), _expand(k.double(), hq), _expand(v.double(), hq)
        raw, s = _scores(qd, kd, scale, softcap)
        m = _mask(q.shape[1], k.shape[1], causal, window, q.device)
        lse = lse.double()
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), float("inf"))[..., None]) * m
        do = dout.double()
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
        d = (do * out.double()).sum(-1).transpose(1, 2)  # (b, h, sq)
        ds = p * (dp - d[..., None])
        if softcap > 0:
            ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, qd) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        b, sk, _, dh = dk.shape
        dk = dk.reshape(b, sk, hkv, hq // hkv, dh).sum(3)
        dv = dv.reshape(b, sk, hkv, hq // hkv, dv.shape[-1]).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _split(self, cu_q, cu_k):
        cq, ck = cu_q.tolist(), cu_k.tolist()
        return [(a, b, c, d) for (a, b), (c, d) in zip(pairwise(cq), pairwise(ck), strict=True)]

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, sink=None):
        assert int((cu_q[1:] - cu_q[:-1]).max()) <= max_q and int((cu_k[1:] - cu_k[:-1]).max()) <= max_k
        outs, lses = [], []
        for a, b, c, d in self._split(cu_q, cu_k):
            o, lse = self.forward(q[None, a:b], k[None, c:d], v[None, c:d], causal, scale, window, softcap,
                                  sink)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap
    ):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d in self._split(cu_q, cu_k):
            g = self.backward(
                dout[None, a:b],
                q[None, a:b],
                k[None, c:d],
                v[None, c:d],
                out[None, a:b],
                lse[None, :, a:b],
                causal,
                scale,
                window,
                softcap,
            )
            dq[a:b] += g[0][0]
            dk[c:d] += g[1][0]
            dv[c:d] += g[2][0]
        return dq, dk, dv


def full_reference(q, k, v, causal, scale, window, softcap, dtype=torch.float64, sink=None):
    """out, lse and the leaves (q, k, v, and the sink when given) whose grads backward gives, on
    the gathered sequence, by autograd in ``dtype`` (float64: the truth; the inputs' dtype: the
    bar of the criterion). ``sink``: (heads,) logits in every row's softmax, with no value."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    qd, kd, vd = q, _expand(k, q.shape[2]), _expand(v, q.shape[2])
    _, s = _scores(qd, kd, scale, softcap)
    m = _mask(q.shape[1], k.shape[1], causal, window, q.device)
    s = s.masked_fill(~m, float("-inf"))
    leaves = (q, k, v)
    if sink is not None:
        sink = sink.detach().to(dtype).requires_grad_()
        leaves += (sink,)
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    return out, lse, leaves


def offsets(seqlens: list[int]) -> list[int]:
    """cu_seqlens of a pack of ``seqlens``."""
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    return cu


def packed_reference(q, k, v, w, cu, causal, scale, window, softcap, dtype=torch.float64, sink=None):
    """float64 CPU tensors [out, lse (heads, total), dq, dk, dv] of a pack, each sequence by
    ``full_reference`` in ``dtype``, the gradients of sum(out * w); with a ``sink``, its gradient
    (summed over the sequences) last."""
    out = torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float64)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    d_sink = None if sink is None else torch.zeros(sink.shape, dtype=torch.float64)
    for a, b in pairwise(cu):
        if b == a:
            continue
        rows = slice(a, b)
        o, l, leaves = full_reference(q[None, rows], k[None, rows], v[None, rows], causal, scale, window,
                                      softcap, dtype, sink=sink)
        (o.double() * w[None, a:b]).sum().backward()
        out[a:b], lse[:, a:b] = o[0].detach().double().cpu(), l[0].detach().double().cpu()
        for acc, leaf in zip(grads, leaves[:3], strict=True):
            acc[a:b] = leaf.grad[0].double().cpu()
        if sink is not None:
            d_sink += leaves[3].grad.double().cpu()
    return [out, lse, *grads] + ([] if sink is None else [d_sink])


def _check(err: dict, tag, worst: dict, rank: int) -> None:
    """Each error within rounding of float64 (the sink's gradient, float32, relative)."""
    for key, e in err.items():
        assert e < (1e-6 if key == "dsink_rel" else 1e-9), f"rank {rank}: {tag} {key} error {e}"
        worst[key] = max(worst.get(key, 0.0), e)


# ------------------------------------------------------------------------------- process cases


def init(rank: int, world: int, init_file: str, backend: str) -> None:
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def dense_case(
    rank,
    world,
    *,
    fn,
    layout,
    causal,
    window,
    softcap,
    heads,
    heads_kv,
    seq_per_rank,
    dtype,
    device,
    attention=None,
    seed=0,
    batch=2,
    head_dim=16,
    sink=False,
):
    """One dense case: the largest errors of this rank's rows of out, lse, dq, dk and dv (and the
    sink's gradient summed over the ranks, relative) against the float64 gathered reference."""
    import numbaflash.distributed as nd

    g = torch.Generator().manual_seed(seed)
    S = seq_per_rank * world
    q = torch.randn(batch, S, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, S, heads_kv, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, S, heads_kv, head_dim, generator=g, dtype=torch.float64)
    w = torch.randn(batch, S, heads, head_dim, generator=g, dtype=torch.float64)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    scale = 1.0 / math.sqrt(head_dim)
    sinks = torch.randn(heads, generator=g).float() if sink else None
    ref_out, ref_lse, leaves = full_reference(q, k, v, causal, scale, window, softcap, sink=sinks)
    (ref_out * w).sum().backward()
    local = [nd.shard(x, layout, world, rank).to(device).requires_grad_() for x in (q, k, v)]
    my_sink = sinks.to(device).requires_grad_() if sink else None
    out, lse = fn(
        *local,
        causal=causal,
        softmax_scale=scale,
        window_size=window,
        softcap=softcap,
        layout=layout,
        return_lse=True,
        learnable_sink=my_sink,
        _attention=attention,
    )
    (out.double() * nd.shard(w, layout, world, rank).to(device)).sum().backward()
    mine = lambda x: nd.shard(x, layout, world, rank)  # noqa: E731
    err = {
        "out": (out.double().cpu() - mine(ref_out.detach())).abs().max().item(),
        "lse": (lse.double().cpu() - mine(ref_lse.detach().transpose(1, 2)).transpose(1, 2))
        .abs()
        .max()
        .item(),
    }
    for name, x, leaf in zip("qkv", local, leaves[:3], strict=True):
        err["d" + name] = (x.grad.double().cpu() - mine(leaf.grad)).abs().max().item()
    if sink:
        total = my_sink.grad.clone()
        dist.all_reduce(total)  # each rank's share, summed as a weight's gradient is
        want = leaves[3].grad
        # relative: the sink and its gradient are float32
        err["dsink_rel"] = ((total.double().cpu() - want).abs().max() / want.abs().max()).item()
    return err


def varlen_case(
    rank,
    world,
    *,
    layout,
    fn=None,
    causal,
    window,
    softcap,
    heads,
    heads_kv,
    seqlens,
    dtype,
    device,
    attention=None,
    seed=0,
    head_dim=16,
    sink=False,
):
    """A packed case: sequences of ``seqlens`` each sharded on its own; errors as ``dense_case``
    (``sink``: a learnable sink, float32, its gradient summed over the ranks)."""
    import numbaflash.distributed as nd

    g = torch.Generator().manual_seed(seed)
    cu = offsets(seqlens)
    total = cu[-1]
    q = torch.randn(total, heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(total, heads_kv, head_dim, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(total, heads_kv, head_dim, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(total, heads, head_dim, generator=g, dtype=torch.float64)
    scale = 1.0 / math.sqrt(head_dim)
    sinks = torch.randn(heads, generator=g).float() if sink else None
    ref_out, ref_lse, *grads = packed_reference(q, k, v, w, cu, causal, scale, window, softcap, sink=sinks)
    local = [nd.shard_varlen(x, cu, layout, world, rank).to(device).requires_grad_() for x in (q, k, v)]
    my_sink = sinks.to(device).requires_grad_() if sink else None
    out, lse = (fn or nd.ring_attention_varlen)(
        *local,
        cu,
        causal=causal,
        softmax_scale=scale,
        window_size=window,
        softcap=softcap,
        layout=layout,
        return_lse=True,
        learnable_sink=my_sink,
        _attention=attention,
    )
    (out.double() * nd.shard_varlen(w, cu, layout, world, rank).to(device)).sum().backward()
    mine = lambda x: nd.shard_varlen(x, cu, layout, world, rank)  # noqa: E731
    err = {
        "out": (out.double().cpu() - mine(ref_out)).abs().max().item(),
        "lse": (lse.double().cpu().t() - mine(ref_lse.t())).abs().max().item(),
    }
    for name, x, ref in zip("qkv", local, grads[:3], strict=True):
        err["d" + name] = (x.grad.double().cpu() - mine(ref)).abs().max().item()
    if sink:
        total = my_sink.grad.clone()
        dist.all_reduce(total)  # each rank's share, summed as a weight's gradient is
        err["dsink_rel"] = ((total.double().cpu() - grads[3]).abs().max() / grads[3].abs().max()).item()
    return err


def _fused_kv_case(rank, world, ref) -> int:
    """k and v as views of one fused (batch, seqlen, 2 * heads_kv, d) projection (not dense): the
    ring sends them all the same, and the fused tensor's gradient is the dense call's dk and dv."""
    import numbaflash.distributed as nd

    g = torch.Generator().manual_seed(99)
    q, k, v = (torch.randn(2, 4 * world, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dense = [x.clone().requires_grad_() for x in (q, k, v)]
    out = nd.ring_attention(*dense, causal=True, _attention=ref)
    out.sum().backward()
    fused = torch.cat([k, v], dim=2).requires_grad_()
    q2 = q.clone().requires_grad_()
    out2 = nd.ring_attention(q2, fused[:, :, :2], fused[:, :, 2:], causal=True, _attention=ref)
    out2.sum().backward()
    assert torch.equal(out, out2), f"rank {rank}: fused k, v changed out"
    want = torch.cat([dense[1].grad, dense[2].grad], dim=2)
    assert torch.equal(fused.grad, want), f"rank {rank}: fused grads"
    return 1


def cpu_worker(rank: int, world: int, init_file: str, result_dir: str, full: bool = True) -> None:
    """Every CPU case on gloo, float64 through ``ReferenceAttention``: the ring's schedule, merge
    and gradient routing must be exact to rounding. ``full=False``: two of the five windows and
    two of the three head layouts (CI time)."""
    import numbaflash.distributed as nd

    init(rank, world, init_file, "gloo")
    ref = ReferenceAttention()
    worst = {}
    cases = 0
    windows = [(-1, -1), (3, 0), (5, 2), (0, 0), (2, -1)] if full else [(-1, -1), (5, 2)]
    heads_layouts = ((4, 4, 0.0), (4, 2, 0.0), (2, 1, 3.0)) if full else ((4, 2, 0.0), (2, 1, 3.0))
    for layout in ("zigzag", "contiguous", "stripe"):
        for causal in (False, True):
            for window in windows:
                for heads, heads_kv, softcap in heads_layouts:
                    for fn in (nd.ring_attention, nd.ulysses_attention):
                        spread = heads_kv % world == 0 or world % heads_kv == 0
                        if fn is nd.ulysses_attention and (heads % world or not spread):
                            continue
                        err = dense_case(
                            rank,
                            world,
                            fn=fn,
                            layout=layout,
                            causal=causal,
                            window=window,
                            softcap=softcap,
                            heads=heads,
                            heads_kv=heads_kv,
                            seq_per_rank=6 if layout == "zigzag" else 5,
                            dtype=torch.float64,
                            device="cpu",
                            attention=ref,
                            seed=cases,
                            sink=heads_kv == 2,  # the GQA case with gpt-oss's learnable sink
                        )
                        cases += 1
                        tag = (fn.__name__, layout, causal, window, heads, heads_kv, softcap)
                        _check(err, tag, worst, rank)
    cases += _fused_kv_case(rank, world, ref)
    if world > 1:  # a group this rank is not in: a clear error, not a hang
        only_first = dist.new_group([0])
        if rank > 0:
            x = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
            try:
                nd.ring_attention(x, x, x, group=only_first, _attention=ref)
            except ValueError as e:
                assert "not a member" in str(e), e
            else:
                raise AssertionError("ring_attention on a group without this rank did not raise")
    for layout in ("zigzag", "contiguous"):
        for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (3, 0))):
            seqlens = [2 * world * 3, 0, 2 * world, 2 * world * 5]
            if world in (1, 2):  # heads 4/2 divide over these ranks
                err = varlen_case(rank, world, layout=layout, fn=nd.ulysses_attention_varlen, causal=causal,
                                  window=window, softcap=0.0, heads=4, heads_kv=2, seqlens=seqlens,
                                  dtype=torch.float64, device="cpu", attention=ref, seed=cases,
                                  sink=window != (-1, -1))
                cases += 1
                _check(err, ("ulysses varlen", layout, causal, window), worst, rank)
            err = varlen_case(
                rank,
                world,
                layout=layout,
                causal=causal,
                window=window,
                softcap=0.0,
                heads=4,
                heads_kv=2,
                seqlens=seqlens,
                dtype=torch.float64,
                device="cpu",
                attention=ref,
                seed=cases,
                sink=window != (-1, -1),  # packed with gpt-oss's sink and window
            )
            cases += 1
            _check(err, ("varlen", layout, causal, window), worst, rank)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{cases} {worst}\n")
    dist.destroy_process_group()


def gpu_worker(rank: int, world: int, init_file: str, backend: str, result_dir: str) -> None:
    """The GPU cases: numbaflash's kernels under the ring and the all-to-all, bf16, against the
    float64 attention of the gathered sequence; FlashAttention's criterion (error at most 3x the
    same attention's in bf16, plus a floor) on out and on dq, dk, dv. ``backend``: "nccl" (one
    GPU a rank) or "gloo" (ranks sharing GPUs, tensors staged through the host)."""
    import numbaflash.distributed as nd

    init(rank, world, init_file, backend)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    lines = []
    failures = []
    cases = [
        # (fn, layout, causal, window, heads, heads_kv, head_dim, seq_per_rank, softcap)
        (nd.ring_attention, "zigzag", True, (-1, -1), 8, 2, 128, 2 * 189, 0.0),
        (nd.ring_attention, "zigzag", False, (-1, -1), 8, 8, 64, 2 * 160, 0.0),
        (nd.ring_attention, "contiguous", True, (-1, -1), 8, 2, 128, 301, 0.0),
        (nd.ring_attention, "contiguous", False, (-1, -1), 4, 1, 64, 256, 0.0),
        (nd.ring_attention, "zigzag", True, (100, 0), 8, 2, 128, 2 * 150, 0.0),
        (nd.ring_attention, "contiguous", False, (77, 33), 8, 4, 64, 200, 0.0),
        (nd.ring_attention, "stripe", True, (-1, -1), 8, 2, 128, 200, 0.0),
        (nd.ring_attention, "zigzag", True, (-1, -1), 8, 2, 128, 2 * 128, 20.0),
        (nd.ulysses_attention, "contiguous", True, (-1, -1), 8, 4, 128, 300, 0.0),
        (nd.ulysses_attention, "zigzag", True, (64, 0), 8, 4, 64, 2 * 120, 0.0),
    ]
    sink_cases = [  # gpt-oss: a sliding window and a learnable sink
        (nd.ring_attention, "zigzag", True, (128, 0), 8, 2, 64, 2 * 150, 0.0),
        (nd.ulysses_attention, "contiguous", True, (-1, -1), 8, 4, 64, 256, 0.0),
    ]
    flagged = [(c, False) for c in cases] + [(c, True) for c in sink_cases]
    for i, (case, sink) in enumerate(flagged):
        fn, layout, causal, window, heads, heads_kv, head_dim, spr, softcap = case
        spread = heads_kv % world == 0 or world % heads_kv == 0
        if fn is nd.ulysses_attention and (heads % world or not spread):
            continue
        tag = f"{fn.__name__} {layout} causal={causal} window={window} {heads}/{heads_kv} d{head_dim}"
        tag += f" {spr}/rank"
        if softcap:
            tag += f" softcap={softcap}"
        if sink:
            tag += " learnable sink"
        run = partial(_gpu_dense, rank, world, fn, layout, causal, window, heads, heads_kv, head_dim, spr,
                      softcap, device, seed=100 + i, sink=sink)
        _record(tag, lines, failures, run)
    for fn, layout, causal, window in ((nd.ring_attention_varlen, "zigzag", True, (-1, -1)),
                                       (nd.ring_attention_varlen, "contiguous", False, (-1, -1)),
                                       (nd.ring_attention_varlen, "zigzag", True, (90, 0)),
                                       (nd.ulysses_attention_varlen, "zigzag", True, (-1, -1))):
        if fn is nd.ulysses_attention_varlen and (8 % world or 2 % world):
            continue
        seqlens = [2 * world * 97, 2 * world * 3, 0, 2 * world * 160]
        tag = f"{fn.__name__} {layout} causal={causal} window={window} seqlens={seqlens}"
        case = partial(_gpu_varlen, rank, world, layout, causal, window, seqlens, device, seed=7, fn=fn)
        _record(tag, lines, failures, case)
    torch.cuda.synchronize()
    with open(os.path.join(result_dir, f"gpu_rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    assert not failures, f"rank {rank}: " + "; ".join(failures)


def _record(tag, lines, failures, case):
    """Run one case and judge it; an exception is recorded (every rank raises alike: the inputs
    are the same) so that the table of every case comes back."""
    try:
        errs = case()
    except Exception as e:  # noqa: BLE001
        lines.append(f"{tag}: raised {type(e).__name__}: {e}")
        failures.append(f"{tag}: raised {e!r}")
        return
    _judge(tag, errs, lines, failures)


def _judge(tag, errs, lines, failures):
    """FlashAttention's criterion: each error at most 3x the bf16 attention's, plus a floor."""
    parts = []
    for key, (ours, bar, single) in errs.items():
        ok = ours <= 3 * bar + 1e-4
        parts.append(
            f"{key} {ours:.2e} (bf16 {bar:.2e}, single-GPU call {single:.2e}){'' if ok else ' FAIL'}"
        )
        if not ok:
            failures.append(f"{tag}: {key} {ours:.3e} > 3 x {bar:.3e}")
    lines.append(f"{tag}: " + ", ".join(parts))


def _errors(mine, ref64, ref16, single, got):
    return (
        (got.double().cpu() - mine(ref64)).abs().max().item(),
        (mine(ref16).double() - mine(ref64)).abs().max().item(),
        (mine(single).double() - mine(ref64)).abs().max().item(),
    )


def _gpu_dense(
    rank, world, fn, layout, causal, window, heads, heads_kv, head_dim, spr, softcap, device, seed, sink=False
):
    import numbaflash
    import numbaflash.distributed as nd

    g = torch.Generator(device=device).manual_seed(seed)
    S, b = spr * world, 2
    q = torch.randn(b, S, heads, head_dim, generator=g, device=device).bfloat16()
    k = torch.randn(b, S, heads_kv, head_dim, generator=g, device=device).bfloat16()
    v = torch.randn(b, S, heads_kv, head_dim, generator=g, device=device).bfloat16()
    w = torch.randn(b, S, heads, head_dim, generator=g, device=device)
    sinks = torch.randn(heads, generator=g, device=device) if sink else None
    scale = 1.0 / math.sqrt(head_dim)
    refs = []
    for dtype in (torch.float64, torch.bfloat16):
        out, _, leaves = full_reference(q, k, v, causal, scale, window, softcap, dtype, sink=sinks)
        (out.double() * w).sum().backward()
        refs.append([out.detach().cpu()] + [x.grad.cpu() for x in leaves])
    single_in = [x.clone().requires_grad_() for x in (q, k, v)]
    single_in += [sinks.clone().requires_grad_()] if sink else []
    single = numbaflash.flash_attention(*single_in[:3], causal=causal, softmax_scale=scale,
                                        window_size=window, softcap=softcap,
                                        learnable_sink=single_in[3] if sink else None)
    (single.double() * w).sum().backward()
    singles = [single.detach().cpu()] + [x.grad.cpu() for x in single_in]
    local = [nd.shard(x, layout, world, rank).requires_grad_() for x in (q, k, v)]
    my_sink = sinks.clone().requires_grad_() if sink else None
    out = fn(*local, causal=causal, softmax_scale=scale, window_size=window, softcap=softcap, layout=layout,
             learnable_sink=my_sink)
    (out.double() * nd.shard(w, layout, world, rank)).sum().backward()
    got = [out.detach()] + [x.grad for x in local]
    mine = lambda x: nd.shard(x, layout, world, rank)  # noqa: E731
    errs = {
        key: _errors(mine, refs[0][i], refs[1][i], singles[i], got[i])
        for i, key in enumerate(("out", "dq", "dk", "dv"))
    }
    if sink:  # the ranks' shares summed, as a weight's gradient is (NCCL and gloo reduce CUDA tensors)
        total = my_sink.grad.clone()
        dist.all_reduce(total)
        whole = lambda x: x  # noqa: E731
        errs["dsink"] = _errors(whole, refs[0][4], refs[1][4], singles[4], total)
    return errs


def _gpu_varlen(
    rank, world, layout, causal, window, seqlens, device, seed, heads=8, heads_kv=2, head_dim=128, fn=None
):
    import numbaflash
    import numbaflash.distributed as nd

    g = torch.Generator(device=device).manual_seed(seed)
    cu = offsets(seqlens)
    total = cu[-1]
    q = torch.randn(total, heads, head_dim, generator=g, device=device).bfloat16()
    k = torch.randn(total, heads_kv, head_dim, generator=g, device=device).bfloat16()
    v = torch.randn(total, heads_kv, head_dim, generator=g, device=device).bfloat16()
    w = torch.randn(total, heads, head_dim, generator=g, device=device)
    scale = 1.0 / math.sqrt(head_dim)
    refs = []
    for dtype in (torch.float64, torch.bfloat16):
        out, _, *grads = packed_reference(q, k, v, w, cu, causal, scale, window, 0.0, dtype)
        refs.append([out, *grads])
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    single_in = [x.clone().requires_grad_() for x in (q, k, v)]
    m = max(seqlens)
    single = numbaflash.flash_attention_varlen(
        *single_in, cu_t, cu_t, m, m, causal=causal, softmax_scale=scale, window_size=window
    )
    (single.double() * w).sum().backward()
    singles = [single.detach().cpu()] + [x.grad.cpu() for x in single_in]
    local = [nd.shard_varlen(x, cu, layout, world, rank).requires_grad_() for x in (q, k, v)]
    out = (fn or nd.ring_attention_varlen)(
        *local, cu, causal=causal, softmax_scale=scale, window_size=window, layout=layout
    )
    (out.double() * nd.shard_varlen(w, cu, layout, world, rank)).sum().backward()
    got = [out.detach()] + [x.grad for x in local]
    mine = lambda x: nd.shard_varlen(x, cu, layout, world, rank)  # noqa: E731
    return {
        key: _errors(mine, refs[0][i], refs[1][i], singles[i], got[i])
        for i, key in enumerate(("out", "dq", "dk", "dv"))
    }


def hf_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    """transformers models on numbaflash inside ``context_parallel`` (gloo, the kernels replaced
    by ``ReferenceAttention``): each rank's logits and the weights' gradients summed over the
    ranks equal the eager model's on the gathered sequence. Llama, Mistral (sliding window) and
    gpt-oss (sinks, alternating windows), zigzag and contiguous."""
    import copy

    import transformers

    import numbaflash.distributed as nd
    from numbaflash import torch_ops
    from numbaflash.integrations import transformers as nf_hf

    init(rank, world, init_file, "gloo")
    ref = ReferenceAttention()
    def forward(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, sink=None):
        return ref.forward(q, k, v, causal, scale, window, softcap, sink)

    torch_ops.run_forward = forward

    def backward(dout, q, k, v, out, lse, causal, scale, _deterministic, window=(-1, -1), softcap=0.0):
        return ref.backward(dout, q, k, v, out, lse, causal, scale, window, softcap)

    torch_ops.run_backward = backward
    torch_ops.check_tensors = lambda *args, **kwargs: None  # float32 here
    nf_hf.register()
    base = {"vocab_size": 97, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "max_position_embeddings": 256, "pad_token_id": 0, "attention_dropout": 0.0}
    configs = [
        (transformers.LlamaConfig, {}),
        (transformers.MistralConfig, {"sliding_window": 6}),
        (transformers.GptOssConfig, {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 6,
                                     "layer_types": ["sliding_attention", "full_attention"]}),
    ]
    seqlen = 8 * world
    worst = 0.0
    for (config_class, overrides), layout in product(configs, ("zigzag", "contiguous")):
        config = config_class(**{**base, **overrides})
        torch.manual_seed(0)
        make = transformers.AutoModelForCausalLM.from_config
        ours = make(copy.deepcopy(config), attn_implementation="numbaflash")
        eager = make(copy.deepcopy(config), attn_implementation="eager")
        with torch.no_grad():
            for name, param in ours.named_parameters():
                if name.endswith("sinks"):
                    param.normal_()
        eager.load_state_dict(ours.state_dict())
        ours.train()
        eager.train()
        ids = torch.randint(1, 97, (1, seqlen), generator=torch.Generator().manual_seed(1))
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # shifted on the whole sequence
        want = eager(ids, use_cache=False).logits
        F = torch.nn.functional
        F.cross_entropy(want[0], labels[0], ignore_index=-100, reduction="sum").backward()
        mine = partial(nd.shard, layout=layout, world=world, rank=rank)
        positions = torch.tensor(nd.positions(layout, seqlen, world, rank))[None]
        with nf_hf.context_parallel(layout=layout):
            got = ours(mine(ids), position_ids=positions, use_cache=False).logits
        F.cross_entropy(got[0], mine(labels)[0], ignore_index=-100, reduction="sum").backward()
        err = (got - mine(want)).abs().max().item()
        for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
            if a.grad is None:
                assert b.grad is None or not b.grad.any(), name
                continue
            total = a.grad.clone()
            dist.all_reduce(total)  # the weights' gradients summed over the ranks
            err = max(err, ((total - b.grad).abs().max() / (b.grad.abs().max() + 1e-12)).item())
        assert err < 1e-4, f"rank {rank}: {config_class.__name__} {layout}: error {err}"
        worst = max(worst, err)
    with open(os.path.join(result_dir, f"hf_rank{rank}.txt"), "w") as f:
        f.write(f"{len(configs) * 2} {worst}\n")
    dist.destroy_process_group()


def sink_rounding_worker(rank: int, world: int, init_file: str) -> None:
    """bf16 with a learnable sink. One rank: the ring's one call and Ulysses' equal the single call
    with the sink bit for bit (out and lse). Two ranks, zigzag, causal window (3, 0): every row
    whose keys all lie in its own chunk (its whole result one call's) equals the single call bit
    for bit. The sink must go into the call that makes a row's result, which folds it in before
    its one rounding; folded into the rounded output afterwards, out is rounded twice (on the GPU
    1.4-1.9x the single call's error)."""
    import numbaflash.distributed as nd

    init(rank, world, init_file, "gloo")
    ref = ReferenceAttention()
    if world > 1:
        g = torch.Generator().manual_seed(11)
        chunk = 6
        shape = (1, 2 * chunk * world)
        q, k, v = (torch.randn(*shape, heads, 16, generator=g).bfloat16() for heads in (4, 2, 2))
        sink = torch.randn(4, generator=g)
        want = nd.shard(ref.forward(q, k, v, True, 0.25, (3, 0), 0.0, sink)[0], "zigzag", world, rank)
        local = [nd.shard(x, "zigzag", world, rank) for x in (q, k, v)]
        got = nd.ring_attention(*local, causal=True, softmax_scale=0.25, window_size=(3, 0), layout="zigzag",
                                learnable_sink=sink, _attention=ref)
        position = torch.tensor(nd.positions("zigzag", q.shape[1], world, rank))
        alone = (position - 3).clamp(min=0) >= position // chunk * chunk  # the window inside the chunk
        assert alone.sum() >= chunk
        gap = (got - want)[0, alone].abs().max().item()
        assert torch.equal(got[0, alone], want[0, alone]), (rank, gap)
        return
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 24, heads, 16, generator=g).bfloat16() for heads in (4, 2, 2))
    sink = torch.randn(4, generator=g)
    for window in ((-1, -1), (5, 0)):
        want, want_lse = ref.forward(q, k, v, True, 0.25, window, 0.0, sink)
        for fn in (nd.ring_attention, nd.ulysses_attention):
            for layout in ("zigzag", "contiguous"):
                out, lse = fn(q, k, v, causal=True, softmax_scale=0.25, window_size=window, layout=layout,
                              learnable_sink=sink, return_lse=True, _attention=ref)
                tag = (fn.__name__, layout, window)
                assert torch.equal(out, want), (tag, (out.float() - want.float()).abs().max().item())
                assert torch.equal(lse, want_lse), tag
        cu = [0, 10, 24]  # packed: two sequences
        packed = [x[0] for x in (q, k, v)]
        want = torch.cat([ref.forward(*(x[None, a:b] for x in packed), True, 0.25, window, 0.0, sink)[0][0]
                          for a, b in pairwise(cu)])
        for fn in (nd.ring_attention_varlen, nd.ulysses_attention_varlen):
            out = fn(*packed, cu, causal=True, softmax_scale=0.25, window_size=window, learnable_sink=sink,
                     _attention=ref)
            assert torch.equal(out, want), (fn.__name__, window, (out - want).abs().max().item())
