"""Context parallelism on the CPU with torch (the layouts and the planner, which need nothing:
``test_distributed_layout_cpu.py``): the LSE merge against float64, sharding round trips, the
API's errors, and the whole ring and
all-to-all (forward and backward, every layout, masks, GQA, softcap, packed sequences) in gloo
processes with a float64 stand-in for the single-GPU kernels, against the gathered float64
attention."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the context-parallel tests need it")

import torch.multiprocessing as mp  # noqa: E402
from _distributed_cases import ReferenceAttention, cpu_worker, sink_rounding_worker  # noqa: E402

import numbaflash.distributed as nd  # noqa: E402
from numbaflash.distributed import layout as L  # noqa: E402
from numbaflash.distributed.blocks import merge_  # noqa: E402


def test_merge_matches_float64_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    b, s, h, d, n = 2, 7, 3, 5, 9
    scores = torch.randn(b, h, s, n, generator=g, dtype=torch.float64) * 3
    values = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    scores[:, :, 0, :] = float("-inf")  # a row that sees no key at all
    scores[:, :, 1, :4] = float("-inf")  # a row that sees nothing in the first part
    full_lse = torch.logsumexp(scores, -1)
    full_out = torch.einsum("bhsn,bnhd->bshd", torch.softmax(scores, -1).nan_to_num(0.0), values)
    acc = torch.zeros(b, s, h, d, dtype=torch.float32)
    acc_lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32)
    for part in (slice(0, 4), slice(4, 6), slice(6, 9)):
        sc = scores[..., part]
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - lse.masked_fill(torch.isinf(lse), 0)[..., None])
        out = torch.einsum("bhsn,bnhd->bshd", p, values[:, part])
        merge_(acc, acc_lse, out.to(torch.bfloat16), lse.float())
    assert not torch.isnan(acc).any() and not torch.isnan(acc_lse).any()
    assert torch.equal(acc[:, 0], torch.zeros_like(acc[:, 0])) and torch.isinf(acc_lse[:, :, 0]).all()
    assert (acc_lse.double() - full_lse).abs()[~torch.isinf(full_lse)].max() < 1e-5
    # each part's out was rounded to bfloat16 (as the kernels return it): 2^-8 relative
    assert (acc.double() - full_out).abs().max() < 4e-3 * full_out.abs().max()


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_shard_round_trip(layout):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3):
        parts = [nd.shard(x, layout, world, r) for r in range(world)]
        assert torch.equal(nd.unshard_parts(parts, layout), x)
    cu = [0, 12, 12, 36]
    p = torch.arange(36 * 2).reshape(36, 2)
    for world in (1, 2, 3):
        parts = [nd.shard_varlen(p, cu, layout, world, r) for r in range(world)]
        assert torch.equal(nd.unshard_varlen_parts(parts, cu, layout), p)


def test_errors_before_any_transfer():
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        nd.ring_attention(q, q, q, _attention=ReferenceAttention())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        nd.ring_attention(q.numpy(), q, q)
    with pytest.raises(ValueError, match="window_size"):
        nd.ring_attention(q, q, q, window_size=(-2, 0), _attention=ReferenceAttention())
    with pytest.raises(ValueError, match="4 dimensions"):
        nd.ring_attention(q[0], q[0], q[0], _attention=ReferenceAttention())
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        nd.ring_attention(q, q, q)  # the kernels' own dtype check, before the process group's
    with pytest.raises(TypeError, match="float16 or bfloat16"):  # packed inputs reach it too
        nd.ring_attention_varlen(q[0], q[0], q[0], [0, 8])
    with pytest.raises(ValueError, match="heads_q a multiple|multiple of"):
        kv = torch.zeros(8, 3, 16, dtype=torch.float16)  # 2 query heads over 3 KV heads
        nd.ring_attention_varlen(q[0].half(), kv, kv, [0, 8])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_and_ulysses_in_gloo_processes(tmp_path, world):
    """Every layout, causal or not, five windows, GQA, softcap, ring and all-to-all, and packed
    sequences (an empty one among them) over ``world`` gloo processes, learnable sinks in the GQA
    and the windowed packed cases: each rank's rows of out, LSE, dq, dk and dv equal the gathered
    float64 attention's to 1e-9, the sink's gradient (float32, summed over the ranks) to 1e-6
    relative (the assertions run in the ranks; a failure raises here)."""
    full = world == 2  # three and four ranks: a smaller sweep (time)
    mp.spawn(cpu_worker, args=(world, str(tmp_path / "init"), str(tmp_path), full), nprocs=world)
    reports = sorted(f for f in os.listdir(tmp_path) if f.startswith("rank"))
    assert len(reports) == world
    for f in reports:
        cases = int((tmp_path / f).read_text().split()[0])
        assert cases >= (150 if full else 30)


@pytest.mark.parametrize("world", [1, 2])
def test_a_sink_is_folded_in_by_the_kernel_call(tmp_path, world):
    """bf16 with a learnable sink over gloo ranks: where one call makes a row's result (one rank:
    every row, ring and Ulysses, dense and packed; two ranks: the rows whose window lies in their
    zigzag chunk) it equals the single call's bit for bit, i.e. out is rounded once (the
    assertions run in the ranks)."""
    mp.spawn(sink_rounding_worker, args=(world, str(tmp_path / "init")), nprocs=world)


def test_compiled_caller_breaks_the_graph_around_the_ring(tmp_path):
    """A ``torch.compile``d function that calls ``ring_attention`` (one rank, in this process):
    the ring runs eagerly at a graph break, and out and gradients equal the eager call's."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ref = ReferenceAttention()

        def f(q, k, v):
            return (nd.ring_attention(q * 2, k, v, causal=True, _attention=ref) ** 2).sum()

        g = torch.Generator().manual_seed(3)
        inputs = [torch.randn(1, 8, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
                  for _ in range(3)]
        want = f(*inputs)
        grads = torch.autograd.grad(want, inputs)
        torch._dynamo.reset()
        got = torch.compile(f)(*inputs)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got, inputs), grads, strict=True):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()


def test_transformers_models_in_context_parallel(tmp_path):
    """``numbaflash.integrations.transformers.context_parallel``: Llama, Mistral (sliding window)
    and gpt-oss (sinks, alternating windows) trained on two gloo ranks' shards, zigzag and
    contiguous: each rank's logits and the weights' gradients summed over the ranks equal the
    eager model's on the gathered sequence (the assertions run in the ranks)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from _distributed_cases import hf_worker

    mp.spawn(hf_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for r in range(2):
        cases, worst = (tmp_path / f"hf_rank{r}.txt").read_text().split()
        assert int(cases) == 6 and float(worst) < 1e-4


def test_kernels_get_torchs_deterministic_mode(tmp_path, monkeypatch):
    """The ring's single-GPU backwards run deterministic where torch asks for it (one rank, in this
    process, the kernels' implementations replaced by the float64 stand-in behind a spy)."""
    import torch.distributed as dist

    from numbaflash import torch_ops

    ref, seen = ReferenceAttention(), []
    monkeypatch.setattr(torch_ops, "check_tensors", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch_ops, "run_forward", ref.forward)

    def backward(dout, q, k, v, out, lse, causal, scale, deterministic, window, softcap):
        seen.append(deterministic)
        return ref.backward(dout, q, k, v, out, lse, causal, scale, window, softcap)

    monkeypatch.setattr(torch_ops, "run_backward", backward)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            q = torch.randn(1, 8, 2, 16, dtype=torch.float64, requires_grad=True)
            nd.ring_attention(q, q, q, causal=True).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()
    assert seen == [False, True]
