"""The Hopper backward's split GQA groups, on CPU: how many CTAs a group is split over
(``operations.launch_backward.backward_group_splits``), the workspace that then holds the dK and
dV sums (``workspace_layout(..., split_blocks, block_n)``), and where each CTA works
(``kernels.backward_ws.make_placement``'s ``place``, run through its Python body)."""

from __future__ import annotations

import itertools

import pytest

from numbaflash.kernels.shapes import WsBackwardConfig
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
