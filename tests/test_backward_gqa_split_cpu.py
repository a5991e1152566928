"""The Hopper backward's split GQA groups, on CPU: how many CTAs a group is split over
(``operations.launch_backward.backward_group_splits``), the workspace that then holds the dK and
dV sums (``workspace_layout(..., split_blocks, block_n)``), and where each CTA works
(``kernels.backward_ws.make_placement``'s ``place``, run through its Python body)."""

from __future__ import annotations

import itertools

import pytest

from numbaflash.kernels.shapes import BackwardConfig, WsBackwardConfig
from numbaflash.operations.launch_backward import backward_group_splits, workspace_layout

H200_SMS = 132


# ------------------------------------------------------------------ backward_group_splits


def test_the_llama_shape_splits_its_groups_over_four_ctas():
    """Batch 1, seqlen 4096, 16 query / 4 KV heads, block_n 128: 32 key blocks x 4 KV heads = 128
    CTAs on 132 SMs, one wave; split over 2 it would be 256 < 264 CTAs, so 4 (512 CTAs)."""
    assert backward_group_splits(32, 4, 1, 4, H200_SMS, False) == 4
    assert backward_group_splits(32, 4, 1, 4, H200_SMS, True) == 1  # deterministic: never
    assert backward_group_splits(8, 1, 1, 8, H200_SMS, False) == 8  # 8 / 1 heads at 1k: all 8


def test_a_grid_of_two_waves_or_mha_is_not_split():
    assert backward_group_splits(32, 4, 3, 4, H200_SMS, False) == 1  # 384 CTAs
    assert backward_group_splits(33, 8, 1, 1, H200_SMS, False) == 1  # MHA: nothing to split
    assert backward_group_splits(1, 1, 1, 1, H200_SMS, False) == 1
    assert backward_group_splits(66, 4, 1, 4, H200_SMS, False) == 1  # 264 CTAs: exactly two waves


SHAPES = list(itertools.product((1, 2, 5, 8, 16, 32, 64), (1, 2, 4, 8), (1, 2, 3),
                               (1, 2, 3, 4, 6, 8, 12, 16)))


@pytest.mark.parametrize("sm_count", [1, 16, 78, 114, 132, 148])
def test_invariants(sm_count):
    """The result divides the group; 1 in deterministic mode; the smallest divisor that gives two
    waves (or the group); non-increasing in key blocks, KV heads and batch, non-decreasing in the
    SM count."""
    for key_blocks, heads_kv, batch, group in SHAPES:
        splits = backward_group_splits(key_blocks, heads_kv, batch, group, sm_count, False)
        assert group % splits == 0
        assert backward_group_splits(key_blocks, heads_kv, batch, group, sm_count, True) == 1
        ctas = key_blocks * heads_kv * batch
        fills = [d for d in range(1, group + 1) if group % d == 0 and ctas * d >= 2 * sm_count]
        assert splits == (fills[0] if fills else group)
        for more in ((2 * key_blocks, heads_kv, batch), (key_blocks, 2 * heads_kv, batch),
                     (key_blocks, heads_kv, batch + 1)):
            assert backward_group_splits(*more, group, sm_count, False) <= splits
        assert backward_group_splits(key_blocks, heads_kv, batch, group, 2 * sm_count, False) >= splits


# ------------------------------------------------------------------ the workspace


def test_the_split_workspace_appends_the_sums_and_tickets():
    """The parts of the unsplit workspace stay where they were; the dK and dV sums (2 * block_n *
    head_dim float32 a key block) start 16-byte aligned after the counters, the int32 tickets (one
    a key block) right after them, so that one memset zeroes both."""
    plain = workspace_layout(1, 16, 4096, 128, 64)
    blocks = 32 * 4  # key blocks x KV heads x batch
    lay = workspace_layout(1, 16, 4096, 128, 64, blocks, 128)
    assert lay[:9] == plain[:8] + (lay.total,)
    assert (lay.dkv_elements, lay.ticket_elements) == (blocks * 2 * 128 * 128, blocks)
    assert lay.dkv_accum >= plain.total and lay.dkv_accum % 4 == 0
    assert lay.tickets == lay.dkv_accum + lay.dkv_elements
    assert lay.total == lay.tickets + blocks
    ws = lay.at(1 << 32)
    assert ws[:4] == plain.at(1 << 32)[:4]
    assert ws.dkv_accum == ((1 << 32) + 4 * lay.dkv_accum, lay.dkv_elements)
    assert ws.tickets == ((1 << 32) + 4 * lay.tickets, blocks)
    assert ws.dkv_accum[0] % 16 == 0
    # the unsplit workspace: no sums (the kernel gets 0-element arrays)
    assert plain.dkv_elements == plain.ticket_elements == 0
    assert plain.at(1 << 32).dkv_accum == plain.at(1 << 32).tickets == (0, 0)


def test_the_sums_are_aligned_after_an_odd_counter_count():
    lay = workspace_layout(1, 1, 1, 64, 128, 3, 128)  # one counter: the sums round up to 16 bytes
    assert lay.counters + lay.counter_elements == lay.counters + 1
    assert lay.dkv_accum % 4 == 0 and lay.dkv_accum > lay.counters


# ------------------------------------------------------------------ where each CTA works


def _place(monkeypatch, group_split):
    """``place``'s Python body, calling ``key_block_of``'s (``test_backward_schedule_cpu.py``), of
    the split build (``group_split``) or of the others."""
    from numbaflash.kernels import backward_ws, blocks

    monkeypatch.setattr(backward_ws, "key_block_of", blocks.key_block_of.py_func)
    return backward_ws.make_placement(WsBackwardConfig(128), group_split).place.py_func


@pytest.mark.parametrize(("key_blocks", "heads_kv", "batch", "group", "splits", "tail"), [
    (3, 2, 2, 4, 1, 0), (3, 2, 2, 4, 2, 0), (3, 2, 2, 4, 4, 5), (5, 1, 1, 8, 8, 3), (2, 3, 2, 6, 3, 4),
    (32, 4, 1, 4, 4, 9),
])
def test_every_query_head_of_every_key_block_once(monkeypatch, key_blocks, heads_kv, batch, group, splits,
                                                  tail):
    """Over the grid, every (key block, batch, query head) is walked by exactly one CTA, whose KV
    head is the query head's; splits == 1 gives every CTA its whole group, as the build that does
    not split does (its placement: the same CTAs, each its whole group)."""
    place = _place(monkeypatch, True)
    pairs = heads_kv * splits * batch
    seen = []
    for cta in range(key_blocks * pairs):
        placed = place(cta, key_blocks, pairs, min(tail, pairs), heads_kv, group, splits)
        n_block, b, kv_head, split_head, heads = (int(x) for x in placed)
        assert heads == group // splits and 0 <= b < batch and 0 <= split_head <= group - heads
        head0 = kv_head * group + split_head
        if splits == 1:
            unsplit = _place(monkeypatch, False)(cta, key_blocks, pairs, min(tail, pairs), heads_kv, group, 1)
            assert tuple(int(x) for x in unsplit) == (n_block, b, kv_head, 0, group)
        for head in range(head0, head0 + heads):
            assert head // group == kv_head
            seen.append((n_block, b, head))
    assert sorted(seen) == sorted(itertools.product(range(key_blocks), range(batch), range(heads_kv * group)))


# ------------------------------------------------------------------ the split build: a variant axis


def test_the_split_build_is_a_spec_axis_with_its_own_cache_key():
    """``KernelSpec.group_split``: the Hopper backward's main kernel only (the siblings drop it),
    named in ``kind``, in the cache key, with ``params.GROUP_SPLIT`` last; the mma.sync backward
    has no split build."""
    from numbaflash.kernels import families, params
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.runtime import cache

    config = WsBackwardConfig(128)
    plain = families.spec_of(config, "backward", True, causal=True)
    split = families.spec_of(config, "backward", True, causal=True, group_split=True)
    assert split != plain and hash(split) != hash(plain) and split.kind == "sm90bwd.backward+group_split"
    key = cache.kernel_key
    assert key(split, sources="s", versions={}) != key(plain, sources="s", versions={})
    assert [split.sibling(op) for op in ("backward_prep", "backward_dq")] == \
        [plain.sibling(op) for op in ("backward_prep", "backward_dq")]
    assert kernel_spec("sm90bwd", "backward_dq", config, group_split=True).group_split is False
    assert families.kernel_params(plain) == params.WS_BACKWARD
    assert families.kernel_params(split) == params.WS_BACKWARD + params.GROUP_SPLIT
    with pytest.raises(NotImplementedError, match="GQA split"):
        families.make_kernel(families.spec_of(BackwardConfig(128), "backward", group_split=True))


def test_the_call_runs_the_split_build_only_where_it_splits(monkeypatch):
    """``call_group_splits``: > 1 (the split build) only for a GQA call, not deterministic, on the
    Hopper backward, whose grid is under two waves."""
    from numbaflash.operations import backward
    from numbaflash.runtime import device

    state = device.GpuState()
    monkeypatch.setattr(device, "GPU", state)
    monkeypatch.setattr(state, "shared_limit", lambda ordinal: 227 * 1024)
    monkeypatch.setattr(state, "sm_count", lambda ordinal: H200_SMS)
    hopper, ampere = (9, 0), (8, 0)
    llama_q, llama_k = (1, 4096, 16, 128), (1, 4096, 4, 128)

    def splits(capability, q, k, deterministic=False, head_dim=128, **variant):
        return backward.call_group_splits(capability, 0, head_dim, True, q, k, deterministic, **variant)

    assert splits(hopper, llama_q, llama_k) == 4
    assert splits(hopper, llama_q, llama_k, deterministic=True) == 1
    assert splits(ampere, llama_q, llama_k) == 1  # the mma.sync backward
    assert splits(hopper, (1, 4096, 4, 128), llama_k) == 1  # MHA
    assert splits(hopper, (8, 4096, 16, 128), (8, 4096, 4, 128)) == 1  # 1024 CTAs
    assert splits(hopper, (1, 4096, 16, 96), (1, 4096, 4, 96), head_dim=96) == 1  # mma.sync at d96
    assert splits(hopper, llama_q, llama_k, softcap=True) == 4  # the variants split too
    c = WsBackwardConfig(128)
    key_blocks = 4096 // c.block_n
    layout = backward.call_workspace(c, llama_q, llama_k, 4)
    assert layout == workspace_layout(1, 16, 4096, 128, c.block_m, key_blocks * 4, c.block_n)
    assert layout.ticket_elements == key_blocks * 4
    assert backward.call_workspace(c, llama_q, llama_k) == workspace_layout(1, 16, 4096, 128, c.block_m)
