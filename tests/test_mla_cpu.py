"""MLA decode (issue 58) without a GPU: the configs and their dispatch, the family and its launches,
the shared-memory layout, and the call's checks before anything launches."""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.kernels import families
from numbaflash.kernels.shapes import MlaDecodeConfig, WsMlaConfig
from numbaflash.kernels.spec import kernel_spec
from numbaflash.operations.launches import LAUNCHES


def test_every_shipped_config_checks_and_fits():
    shipped = configs.shipped_mla_decode_configs()
    assert {c.rows for c in shipped} == {16, 32, 64} and {c.paged for c in shipped} == {False, True}
    for config in shipped:
        config.check()
        assert (config.head_dim, config.value_dim) == configs.MLA_HEAD_DIMS
        if isinstance(config, WsMlaConfig):  # two warpgroups: half of O's columns and of a tile's keys each
            assert config.value_columns * 2 == config.value_dim and config.block_n % 32 == 0
            assert config.threads == 256 and config.rows == 64
            continue
        assert config.score_keys % 16 == 0 and config.value_columns % 64 == 0
        # every warp's O columns and every key slice's rows are covered once
        assert config.value_columns * config.num_warps == config.value_dim
        assert config.score_keys * config.key_warps == config.block_n
        assert config.score_m_tiles * (config.num_warps // config.key_warps) == config.m_tiles


def test_layout_regions_follow_each_other():
    config = MlaDecodeConfig(m_tiles=4, block_n=32, num_warps=8, key_warps=2, stages=3, paged=True)
    assert config.ring_at == 64 * 576 * 2
    assert config.p_at == config.ring_at + 3 * 32 * 576 * 2
    assert config.maxes_at == config.p_at + 64 * 32 * 2  # P: rows x keys 16-bit values
    assert config.page_rows_at == config.maxes_at + 2 * 64 * 4
    assert config.shared_bytes == config.page_rows_at + 2 * 32 * 16
    widest = configs.mla_decode_config((9, 0), 64, True)  # Hopper's 64 rows: the CTA's whole 227 KB
    assert widest.shared_bytes == configs.max_shared_bytes((9, 0)) == 227 * 1024


def test_hopper_layout_fills_the_cta_and_keeps_the_swizzle_atoms_aligned():
    """Q, the ring (a stage a warpgroup), the tile where rows meet and (paged) the page rows, a
    buffer a warpgroup, follow each other from a base aligned up to 1024 bytes (the slack is in
    ``shared_bytes``); every tile starts on a 128B-swizzle atom, and so does a K tile's rotary
    block, where its P goes to the other warpgroup."""
    for paged in (False, True):
        c = WsMlaConfig(paged=paged)
        c.check()
        assert c.ring_at == 64 * 576 * 2 and c.p_at == c.ring_at + 2 * 64 * 576 * 2
        assert c.page_rows_at == c.p_at + 64 * 64 * 2
        assert c.shared_bytes == c.page_rows_at + (2 * 64 * 16 if paged else 0) + 1024
        assert c.shared_bytes <= 227 * 1024 and c.p_at >= 2 * 2 * 64 * 4  # the row maxima fit
        assert all(at % 1024 == 0 for at in (c.ring_at, c.stage_bytes, 8 * 64 * 128))
        assert 64 * 64 * 2 <= c.stage_bytes - 8 * 64 * 128  # a tile's P fits its rotary block
    assert WsMlaConfig(paged=True).shared_bytes == 227 * 1024  # to the byte
    for block_n, stages in ((32, 4), (128, 2), (64, 3)):
        with pytest.raises(ValueError, match="64-key tiles in a ring of 2"):
            WsMlaConfig(block_n=block_n, stages=stages).check()
    with pytest.raises(ValueError, match="takes head dims"):
        WsMlaConfig(head_dim=512, head_dim_v=512).check()


@pytest.mark.parametrize("rows, expected", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (128, 64)])
def test_dispatch_takes_the_fewest_m_tiles_that_hold_the_rows(rows, expected):
    for paged in (False, True):  # the mma.sync kernel (an A100's configs)
        config = configs.mla_decode_config((8, 0), rows, paged)
        assert config.rows == expected and config.paged == paged
        assert config.shared_bytes <= configs.max_shared_bytes((8, 0))


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 64, 128])
def test_hopper_takes_the_wgmma_kernel_above_16_rows(rows):
    for paged in (False, True):
        config = configs.mla_decode_config((9, 0), rows, paged)
        assert isinstance(config, WsMlaConfig) == (rows > 16) and config.paged == paged
        assert config.shared_bytes <= configs.max_shared_bytes((9, 0))
        assert families.family_of(config).name == ("sm90mla" if rows > 16 else "sm80mla")


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (12, 0)])
def test_smaller_shared_memory_gpus_get_configs_that_fit(capability):
    for rows in (16, 32, 64):
        config = configs.mla_decode_config(capability, rows, True)
        assert config.shared_bytes <= configs.max_shared_bytes(capability)
        config.check()
    if capability == (8, 0):  # the A100: 32-key tiles keep 32 and 64 rows a CTA
        assert [configs.mla_decode_config(capability, r, False).rows for r in (16, 32, 64)] == [16, 32, 64]


@pytest.mark.parametrize("bad", [dict(num_warps=8, key_warps=8),  # 8-key slices
                                 dict(m_tiles=1, num_warps=8, key_warps=4),  # 2 m-tile groups, 1 m-tile
                                 dict(m_tiles=4, block_n=64, stages=3),  # > 227 KB
                                 dict(head_dim=576, head_dim_v=600)])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError):
        MlaDecodeConfig(**bad).check()


def test_family_factories_and_launches():
    config = configs.mla_decode_config((8, 0), 64, True)
    assert families.family_of(config) is families.SM80_MLA
    spec = kernel_spec("sm80mla", "decode", config, "bfloat16", "sm_80", causal=True)
    assert spec.paged and spec.kind == "sm80mla.decode+paged"
    combine = spec.sibling("decode_combine")
    assert not combine.causal and not combine.paged
    for operation in families.DECODE_OPERATIONS:
        assert ("sm80mla", operation) in families.FACTORIES and ("sm80mla", operation) in LAUNCHES
    decode = kernel_spec("sm80dec", "decode", configs.decode_config((9, 0), 128, 16, True))
    assert families.kernel_params(spec) == families.kernel_params(decode)  # the plain decode kernel's
    names = {p.name for p in families.kernel_source_files("sm80mla", "decode")}
    assert {"mla_decode.py", "decode_mma.py", "mma_pieces.py"} <= names
    hopper = configs.mla_decode_config((9, 0), 64, True)
    assert families.family_of(hopper) is families.SM90_MLA
    ws = kernel_spec("sm90mla", "decode", hopper, "bfloat16", "sm_90a", causal=True)
    assert ws.kind == "sm90mla.decode+paged" and families.kernel_params(ws) == families.kernel_params(decode)
    for operation in families.DECODE_OPERATIONS:
        assert ("sm90mla", operation) in families.FACTORIES and ("sm90mla", operation) in LAUNCHES
    names = {p.name for p in families.kernel_source_files("sm90mla", "decode")}
    assert {"mla_ws.py", "wgmma_gemms.py", "decode_mma.py"} <= names


def test_checks_before_anything_launches():
    q = np.zeros((2, 1, 16, 576), np.float16)
    cache = np.zeros((2, 64, 1, 576), np.float16)
    lens = np.array([3, 64], np.int32)
    with pytest.raises(ValueError, match="q's head_dim must be 576"):
        numbaflash.flash_mla_with_kvcache(q[..., :512], cache, lens)
    with pytest.raises(ValueError, match="kv_cache must be"):
        numbaflash.flash_mla_with_kvcache(q, np.zeros((2, 64, 2, 576), np.float16), lens)
    with pytest.raises(ValueError, match="kv_cache must be"):
        numbaflash.flash_mla_with_kvcache(q, cache.astype(np.float32).astype(np.float16)[..., :512], lens)
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        numbaflash.flash_mla_with_kvcache(q, cache, lens, head_dim_v=256)
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        numbaflash.flash_mla_with_kvcache(q, cache, lens, head_dim_v=True)
    with pytest.raises(TypeError, match="takes device arrays"):
        numbaflash.flash_mla_with_kvcache(q, cache, lens)


def reference_mla(q, kv_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits):
    """MLA decode in float32 torch (the custom op's stand-in on CPU tensors): (out, lse)."""
    import torch

    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        rows = (kv_cache[b, :n, 0] if block_table is None
                else torch.cat([kv_cache[int(p), :, 0] for p in block_table[b]])[:n]).float()
        s = torch.einsum("qhd,kd->hqk", q[b].float(), rows) * softmax_scale
        if causal:
            sq = q.shape[1]
            s = s.masked_fill(torch.arange(n)[None, :] > n - sq + torch.arange(sq)[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("hqk,kd->qhd", p, rows[:, :512]).to(q.dtype))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def mla_tensors(torch, paged=True):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 576, generator=gen).half()
    lens = torch.tensor([5, 30], dtype=torch.int32)
    if not paged:
        return q, torch.randn(2, 40, 1, 576, generator=gen).half(), lens, None
    cache = torch.randn(5, 16, 1, 576, generator=gen).half()
    return q, cache, lens, torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)


def test_mla_op_fake_kernel_and_opcheck(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from numbaflash import torch_ops

    monkeypatch.setattr(torch_ops, "run_mla", reference_mla)
    with FakeTensorMode():
        q = torch.empty(3, 2, 16, 576, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(10, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 4, dtype=torch.int32, device="cuda")
        out, lse = numbaflash.flash_mla_with_kvcache(q, cache, lens, table, return_lse=True)
        assert (tuple(out.shape), out.dtype) == ((3, 2, 16, 512), q.dtype)
        assert (tuple(lse.shape), lse.dtype) == ((3, 16, 2), torch.float32)
        with pytest.raises(ValueError, match="kv_cache must be"):
            numbaflash.flash_mla_with_kvcache(q, cache[..., :512], lens, table)
        with pytest.raises(ValueError, match="head_dim_v must be 512"):
            numbaflash.flash_mla_with_kvcache(q, cache, lens, table, head_dim_v=256)
        with pytest.raises(RuntimeError, match="out= is not supported"):
            numbaflash.flash_mla_with_kvcache(q, cache, lens, table, out=out)
    for paged in (False, True):
        q, cache, lens, table = mla_tensors(torch, paged)
        torch.library.opcheck(torch.ops.numbaflash.flash_mla_with_kvcache.default,
                              (q, cache, lens, table, paged, 0.05, 0))


def test_compiled_mla_step_has_no_graph_break(monkeypatch):
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    monkeypatch.setattr(torch_ops, "run_mla", reference_mla)
    torch._dynamo.reset()

    def step(q, cache, lens, table):
        out = numbaflash.flash_mla_with_kvcache(q, cache, lens, table, causal=True)
        lens.add_(1)
        return out

    q, cache, lens, table = mla_tensors(torch)
    explained = torch._dynamo.explain(step)(q, cache, lens.clone(), table)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, cache, lens.clone(), table)
    want, _ = reference_mla(q, cache, lens, table, True, 576 ** -0.5, 0)
    assert torch.equal(got, want)
