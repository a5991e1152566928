"""The Hopper backward's unswapped tile (``kernels.backward_ws_rows``: head dims (192, 128)) on the CPU:
where its consumer warps add dQ (``WsBackwardConfig.dq_add_at``) against the order the prepare and dQ
kernels read (``BackwardConfig.dq_position`` / ``dq_offset`` of ``dq_config``), its shared layout, and
the dispatch (dense calls on Hopper only, no GQA-split build)."""

from __future__ import annotations

import pytest

from numbaflash import configs
from numbaflash.kernels.shapes import SMEM_ALIGN, WsBackwardConfig, WsConfig, block_columns

ROWS = WsBackwardConfig(192, head_dim_v=128)


def test_the_tile_is_two_warpgroups_of_48_keys():
    assert not ROWS.swapped and WsBackwardConfig(128).swapped
    assert (ROWS.consumers, ROWS.block_n, ROWS.threads, ROWS.register_split) == (2, 96, 384, (24, 240))
    assert 128 * ROWS.register_split[0] + 2 * 128 * ROWS.register_split[1] <= 65536
    assert ROWS.barrier_words == 1 + 2 * ROWS.stages + 2  # and the staged dQ's full and empty
    assert ROWS.dq_split == "n" and ROWS.tag == "_s2_v128"
    assert WsBackwardConfig(192, head_dim_v=192) == WsBackwardConfig(192)  # one spelling
    ROWS.check()
    for wrong in (WsBackwardConfig(192), WsBackwardConfig(192, block_m=128, head_dim_v=128),
                  WsBackwardConfig(128, head_dim_v=64),
                  WsBackwardConfig(192, late_rows=True, head_dim_v=128),
                  WsBackwardConfig(192, early_p=True, head_dim_v=128)):  # the swapped tile's knob
        with pytest.raises(ValueError):
            wrong.check()


def test_dq_adds_land_where_the_dq_kernel_reads_them():
    """Element e of n-tile j of lane ``lane`` of warp ``warp`` of warpgroup ``wg`` is dQ's (row 16 warp
    + lane // 4 + 8 (e // 2), column 96 wg + 8 j + 2 (lane % 4) + e % 2): its offset, ``dq_add_at`` + e,
    is where ``dq_config``'s thread that holds that position stores it; every offset once, and the
    kernel's staging offset 4 (256 j + thread) (``backward_ws_rows.stage_dq``)."""
    mma = ROWS.dq_config()
    assert (mma.head_dim, mma.value_dim, mma.block_m, mma.dq_vector) == (192, 128, 64, 4)
    assert not mma.dq_transposed
    assert mma == configs.backward_for_target(configs.ASYMMETRIC_BACKWARD_DEFAULTS[(192, 128)][0], (9, 0))
    where = {}
    for tid in range(mma.threads):
        for i in range(mma.dq_fragment_elements):
            where[mma.dq_position(tid, i)] = mma.dq_offset(tid, i)
    assert len(where) == 64 * 192
    seen = set()
    for wg in range(ROWS.consumers):
        for warp in range(4):
            for lane in range(32):
                for j in range(12):
                    at = ROWS.dq_add_at(wg, warp, lane, j)
                    assert at == 4 * (256 * j + 128 * wg + 32 * warp + lane)  # 16 bytes, as staged
                    for e in range(4):
                        row = 16 * warp + lane // 4 + 8 * (e // 2)
                        col = 96 * wg + 8 * j + 2 * (lane % 4) + e % 2
                        assert where[(row, col)] == at + e
                        seen.add(at + e)
    assert seen == set(range(64 * 192))


def test_the_shared_layout():
    lay = ROWS.layout
    regions = [("k", lay.k, 96 * 192 * 2), ("v", lay.v, 96 * 128 * 2), ("q", lay.q, 2 * 64 * 192 * 2),
               ("do", lay.do, 2 * 64 * 128 * 2), ("ds", lay.ds, lay.ds_bytes), ("p", lay.p, lay.ds_bytes),
               ("dq", lay.dq, 64 * 192 * 4 + 16),  # and the step's turn
               ("lse", lay.lse, 2 * 64 * 4), ("delta", lay.delta, 2 * 64 * 4)]
    assert lay.ds_bytes == 64 * 128 * 2  # 64 query rows of two 128-byte column blocks of 64 keys
    assert (lay.q_stage, lay.do_stage) == (64 * 192 * 2, 64 * 128 * 2)
    assert ROWS.step_bytes == lay.q_stage + lay.do_stage
    end = 0
    for name, at, size in regions:  # in order, none overlapping, every swizzled tile 1024-aligned
        assert at == end, name
        if name not in ("lse", "delta"):
            assert at % SMEM_ALIGN == 0
            assert name not in ("q", "do") or size // 2 % SMEM_ALIGN == 0  # each stage too
        end = at + size
    assert lay.end == end and ROWS.shared_bytes == end + SMEM_ALIGN <= 227 * 1024
    swapped = WsBackwardConfig(128, late_rows=True).layout
    assert swapped.p == swapped.dq == 0 and swapped.do_stage == swapped.q_stage  # the swapped tile's
    assert swapped.lse == swapped.ds + 2 * swapped.ds_bytes


def test_k_is_in_64_byte_rows_so_a_warpgroup_s_dq_is_one_wgmma():
    """K's tile in 32-column blocks of 64-byte rows (FlashAttention-4's layout for the pair): each
    warpgroup's 96 columns of it, dQ's B, are three whole blocks, one m64n96 a k-step; 64-column
    blocks split them into an m64n64 and an m64n32 that read dS twice (docs/PERFORMANCE.md
    [SW64K]). The swapped tiles keep 128-byte rows; each 64-byte block of K is 1024-aligned."""
    assert ROWS.k_row_bytes == 64 and ROWS.row_bytes == 128  # V, Q, dO and the rest: 128
    assert all(WsBackwardConfig(d, **kw).k_row_bytes == 128
               for d, kw in ((128, {}), (128, {"block_m": 80, "late_rows": True}), (64, {"block_m": 128})))
    block_cols = block_columns(ROWS, ROWS.k_row_bytes)  # what K's tile loads and its tensor map take
    assert (block_cols, block_columns(ROWS)) == (32, 64)  # V, Q and dO: 64-column blocks
    assert (96 % block_cols, 96 // block_cols) == (0, 3)  # a warpgroup's dQ columns: whole blocks
    assert ROWS.block_n * ROWS.k_row_bytes % SMEM_ALIGN == 0  # each block of the tile aligned
    assert ROWS.head_dim // block_cols * ROWS.block_n * ROWS.k_row_bytes == 96 * 192 * 2  # the same bytes


def test_dense_hopper_calls_take_the_tile():
    for causal in (False, True):
        for window, softcap in ((False, False), (True, False), (False, True), (True, True)):
            cfg = configs.backward_config((9, 0), 192, causal and not window, window=window, softcap=softcap,
                                          head_dim_v=128)
            assert cfg is configs.ASYMMETRIC_BACKWARD_WS[(192, 128)]
    for capability in ((8, 0), (8, 9), (12, 0)):
        found = configs.backward_config(capability, 192, True, head_dim_v=128)
        assert not isinstance(found, WsBackwardConfig)
    assert not isinstance(configs.backward_config((9, 0), 192, True, head_dim_v=128, varlen=True),
                          WsBackwardConfig)
    # where a lowered limit leaves no room for it: the mma.sync config
    small = configs.backward_config((9, 0), 192, True, 150 * 1024, head_dim_v=128)
    assert not isinstance(small, WsBackwardConfig)


def test_the_tile_has_no_gqa_split_build():
    pytest.importorskip("numba")
    from numbaflash.kernels.backward_ws import make_backward_ws_kernel

    with pytest.raises(ValueError, match="no GQA-split build"):
        make_backward_ws_kernel(ROWS, True, True, group_split=True)


def test_the_forward_s_blocks_follow_its_swizzle_rows():
    """``block_columns`` for the forward's configs (the same rule for its tile loads and its tensor
    maps): 64 columns in 128-byte rows, 32 in 64-byte rows (head dim 96), and e4m3's 64 one-byte
    columns a 64-byte row at head dim 64."""
    assert [block_columns(WsConfig(d)) for d in (64, 96, 128, 256)] == [64, 32, 64, 64]
    assert block_columns(WsConfig(64, fp8=True)) == 64 and WsConfig(64, fp8=True).row_bytes == 64
