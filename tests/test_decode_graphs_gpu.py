"""Every decode config this GPU dispatches (``configs.decode_configs_for``, and the configs of the
head-dim pairs, ``configs.DECODE_HEAD_DIM_PAIRS``) runs inside a CUDA graph whose replays follow
``cache_seqlens`` advancing on the device (issue 58): a step that appends its rows to the cache
and advances the lengths is captured once; each replay's output equals an eager call's on a mirror
of the cache bit for bit, and the caches end equal. Each case first checks that its call
dispatches the config it is named for."""

from __future__ import annotations

import pytest

import numbaflash
from numbaflash import configs
from numbaflash.operations import decode as decode_op
from numbaflash.runtime import device as gpu_state

torch = pytest.importorskip("torch")
CAPACITY = 256  # keys a sequence can hold (paged: CAPACITY / page pages)
STEPS = 4  # graph replays, each appending seqlen_q rows


def _capability() -> tuple[int, int]:
    if not torch.cuda.is_available():
        return (9, 0)  # collection without a GPU: the cases are skipped by the gpu marker
    return torch.cuda.get_device_capability()


def _shapes(capability: tuple[int, int]) -> list[tuple]:
    """(config, head_dim, head_dim_v, rows, page, wide) of each config the GPU dispatches: the
    first call shape (packed rows 16 or 32; contiguous (page 0), paged by rows (pages of 16) or by
    tiles (pages of the config's block_n); a grid within the SMs or wider) that
    ``configs.decode_config`` answers with it."""
    pairs = [(d, 0) for d in configs.SUPPORTED_HEAD_DIMS] + list(configs.DECODE_HEAD_DIM_PAIRS)
    found, seen = [], set()
    for d, dv in pairs:
        for rows in (16, 32):
            for page in (0, 16, 256):
                for wide in (False, True):
                    try:
                        config = configs.decode_config(capability, d, rows, page > 0, wide=wide,
                                                       head_dim_v=dv, page_size=page)
                    except RuntimeError:  # nothing of this head dim fits the GPU's shared memory
                        continue
                    if config not in seen:
                        seen.add(config)
                        found.append((config, d, dv or d, rows, config.block_n if config.page_tiles else page,
                                      wide))
    return found


SHAPES = _shapes(_capability())


def _problem(seed, batch, seqlen_q, heads_kv, group, d, dv, page, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, width):
        return torch.randn(*shape, width, generator=g, device="cuda").to(dtype)

    q = rand(batch, seqlen_q, heads_kv * group, width=d)
    room = CAPACITY - STEPS * seqlen_q
    seqlens = torch.randint(1, room + 1, (batch,), generator=g, device="cuda").to(torch.int32)
    seqlens[0] = room  # one sequence filled to the last row the steps leave
    k_new, v_new = rand(batch, seqlen_q, heads_kv, width=d), rand(batch, seqlen_q, heads_kv, width=dv)
    if not page:
        return q, rand(batch, CAPACITY, heads_kv, width=d), rand(batch, CAPACITY, heads_kv, width=dv), \
            seqlens, k_new, v_new, None
    per_seq = CAPACITY // page
    pages = batch * per_seq + 3
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))[:batch * per_seq]
    table = order.reshape(batch, per_seq).to(torch.int32).cuda()
    return q, rand(pages, page, heads_kv, width=d), rand(pages, page, heads_kv, width=dv), seqlens, \
        k_new, v_new, table


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_every_decode_config_replays_in_a_graph(shape, monkeypatch):
    config, d, dv, rows, page, wide = shape
    heads_kv = 2
    seqlen_q, group = (2, 8) if rows == 16 else (4, 8)  # rows = group * seqlen_q
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = sms // (heads_kv * (rows // 16)) + 1 if wide else 3
    dtype = (torch.float16, torch.bfloat16)[SHAPES.index(shape) % 2]
    q, kc, vc, seqlens, k_new, v_new, table = _problem(SHAPES.index(shape), batch, seqlen_q, heads_kv, group,
                                                       d, dv, page, dtype)
    chosen = []  # the config of each plan made (a fresh plan cache: this call makes one)
    real = decode_op.decode_kernels
    monkeypatch.setattr(decode_op, "decode_kernels",
                        lambda *a, **kw: chosen.append(real(*a, **kw)) or chosen[-1])
    monkeypatch.setattr(gpu_state.GPU, "plans", {})
    mirror = (kc.clone(), vc.clone(), seqlens.clone())
    out = torch.empty(batch, seqlen_q, heads_kv * group, dv, device="cuda", dtype=dtype)
    kwargs = {"k_new": k_new, "v_new": v_new, "block_table": table, "causal": True, "out": out}
    numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)  # warm-up: compiles, plans
    torch.cuda.synchronize()
    assert chosen and chosen[-1].config == config, f"the call dispatched {chosen[-1:]}, not {config}"
    kc.copy_(mirror[0])
    vc.copy_(mirror[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, **kwargs)
        seqlens.add_(seqlen_q)
    kc_eager, vc_eager, lens_eager = mirror
    for step in range(STEPS):
        graph.replay()
        eager = numbaflash.flash_attention_with_kvcache(q, kc_eager, vc_eager, lens_eager, k_new=k_new,
                                                        v_new=v_new, block_table=table, causal=True)
        lens_eager.add_(seqlen_q)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {step}"
    assert torch.equal(seqlens, lens_eager) and torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)
    assert not out.isnan().any()
